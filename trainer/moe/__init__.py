"""Expert-parallel Mixture-of-Experts feed-forward block.

Pure routing (routing.py, capacity.py), row movement (dispatch.py, exchange.py),
experts (experts.py, gmm.py), the per-device computation (core.py), the
shard_map wrapper (parallel.py) and the Flax NNX module (layer.py). The naive
per-expert reference that every fast path is tested against is test code
(tests/trainer/moe_oracle.py).

`MoEBlock` is imported on first use: the config (and so `trainer.config`) stays
importable without jax, for the control plane's config checks.
"""

from trainer.moe.config import MoEConfig

__all__ = ["MoEConfig", "MoEBlock"]


def __getattr__(name: str):
    if name == "MoEBlock":
        from trainer.moe.layer import MoEBlock

        return MoEBlock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
