"""Expert-parallel Mixture-of-Experts feed-forward block.

Pure routing (routing.py, capacity.py), row movement (dispatch.py, exchange.py),
experts (experts.py, gmm.py), the per-device computation (core.py), the
shard_map wrapper (parallel.py) and the Flax NNX module (layer.py). oracle.py
holds the naive per-expert reference that every fast path is tested against.
"""

from trainer.moe.config import MoEConfig
from trainer.moe.layer import MoEBlock

__all__ = ["MoEConfig", "MoEBlock"]
