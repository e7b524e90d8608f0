"""Which TPU kernel a config runs, without jax: the trainer picks by it and the planner counts its memory."""

from __future__ import annotations


def tpu_attention(setting: str, length: int) -> str:
    """The attention a TPU runs for model.attention `setting` and sequences of `length` (trainer/attention.py):
    the splash kernel where its blocks fit (a multiple of 128 positions), XLA's otherwise."""
    if setting != "auto":
        return setting
    return "splash" if length % 128 == 0 else "xla"
