"""The Vertex AI kind (`target: vertex`): a custom job that trains, an endpoint that serves. kind.py (the
`Kind`), vertex_sections.py (its config section), jobs.py (the custom job's lifecycle), endpoints.py (the
endpoint's)."""
