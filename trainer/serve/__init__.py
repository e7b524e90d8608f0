"""Serving a trained checkpoint: the key/value cache, the continuous-batching engine and the
OpenAI-compatible HTTP server (`python -m trainer.serve --checkpoint DIR`).

Importing the package imports nothing heavy: jax comes with `engine`/`weights`, FastAPI with `server`.
"""
