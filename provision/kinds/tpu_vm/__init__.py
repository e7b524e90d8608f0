"""The TPU VM kind (`target: tpu-vm`): a slice on a queued resource, its trainer started by the slice's
startup script. kind.py (the `Kind`), slices.py (the queued resource's lifecycle)."""
