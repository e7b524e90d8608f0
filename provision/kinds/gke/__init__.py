"""The GKE kind (`target: gke`): TPU node pools with a JobSet that trains, a serving pool with a
Deployment that serves. kind.py (the `Kind`), gke_sections.py (its config sections), gke.py (the
cluster, the pools and the JobSet), gke_render.py (their request bodies and manifests), gke_serve.py and
gke_serve_render.py (the serving objects)."""
