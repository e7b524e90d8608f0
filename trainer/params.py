"""The parameters the trainer instantiates, listed without allocating them, and how the mesh splits them.

`param_inventory(cfg)` builds the trainer's own `Transformer` abstractly (`nnx.eval_shape`: shapes and
dtypes, no memory), so every count derived from it (the planner's totals, per-expert and embedding sizes,
bytes per chip) is the model's. trainer/arith/params.py lists the same parameters from the config alone, for
the planner without jax (a test holds the two equal); `shard_ways` (trainer/arith/mesh.py) says how many
ways a parameter is split on a mesh of a given shape. Importing this module imports no jax: jax starts
only inside param_inventory.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from trainer.arith.mesh import shard_ways  # noqa: F401 - how the mesh splits a parameter (no jax)
from trainer.arith.params import DTYPE_BYTES, ParamInfo  # noqa: F401 - what the inventory lists, one place

if TYPE_CHECKING:
    from trainer.config import Config

class _ShapeOnlyRngs:
    """What the model's constructor asks of its nnx.Rngs, for a build that only wants shapes: one fixed
    key for every parameter (under eval_shape no value is ever computed from it).

    Written by hand because nnx.Rngs costs more than the rest of the build there: each draw updates its
    counter, a tracer under eval_shape, and flax then compares the counter's `sharding`, which on a tracer
    raises an error whose message walks every equation traced so far. That is quadratic in the parameters:
    7.7 s against 0.6 s for moe-1.2t's 611, 0.8 s against 0.1 s for v5e-64's 155 (tests/control/test_plan
    checks that the inventory is still what the trainer instantiates)."""

    def params(self):
        import jax

        return jax.random.key(0)

    default = params

    def fork(self) -> _ShapeOnlyRngs:
        return self


@functools.lru_cache(maxsize=8)
def param_inventory(cfg: Config) -> tuple[ParamInfo, ...]:
    """Every parameter `Transformer(cfg)` creates, in the trainer's order, built abstractly (a 1.2T model
    takes seconds to trace, so the answer for a config is kept)."""
    import jax
    from flax import nnx

    from trainer import initializers, sharding
    from trainer.model import ParamCodec, Transformer

    def make_model():
        with nnx.use_eager_sharding(False), initializers.shapes_only():
            return Transformer(cfg, mesh=None, rngs=_ShapeOnlyRngs())

    params = nnx.state(nnx.eval_shape(make_model), nnx.Param)
    infos = []
    for name, var in ParamCodec(params).variables.items():
        value = var.get_value()
        names = sharding.variable_names(var) or (None,) * len(value.shape)
        infos.append(ParamInfo(name=name, shape=tuple(int(d) for d in value.shape),
                               dtype=jax.numpy.dtype(value.dtype).name, axes=tuple(names)))
    return tuple(infos)
