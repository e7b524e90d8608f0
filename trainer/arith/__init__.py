"""The arithmetic the planner (provision/planner) and the trainer share, with no jax, numpy or cloud SDK.

What parameters a config's model holds and their logical axes (params), the counts and training FLOPs taken
from them (counts), how the mesh splits an array by its axes' logical names (mesh), which weights serving
quantizes and how int4 groups them, with the serving memory's constants (quant), and the positions each
layer's KV cache holds (kv). The trainer builds its arrays from these facts; the planner answers from them on
a machine without jax (tests/control/test_house.py holds this package to the standard library).
"""
