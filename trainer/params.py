"""The parameters the trainer instantiates, listed without allocating them, and how the mesh splits them.

`param_inventory(cfg)` builds the trainer's own `Transformer` abstractly (`nnx.eval_shape`: shapes and
dtypes, no memory), so every count derived from it (the planner's totals, per-expert and embedding sizes,
bytes per chip) is the model's, not a second formula. `shard_ways` asks trainer.sharding how many ways a
parameter is split on a mesh of a given shape. Importing this module imports no jax: the control plane
reads `ParamInfo` cheaply, and jax starts only inside the two functions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter: its dotted name (as ParamCodec names it), shape, dtype and logical axis names."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * DTYPE_BYTES[self.dtype]

    @property
    def is_expert(self) -> bool:
        """A routed expert's weight: one slice per expert along the "expert" axis."""
        return "expert" in self.axes

    @property
    def is_matrix(self) -> bool:
        """A weight tokens are multiplied by: two axes or more besides the stacked layers' (trainer/stacks.py),
        where a norm's scale is one."""
        return sum(a != "layers" for a in self.axes) >= 2

    @property
    def is_vocab(self) -> bool:
        """The embedding table or the output head."""
        return "vocab" in self.axes


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

    from trainer import sharding
    from trainer.model import ParamCodec, Transformer

    def make_model():
        with nnx.use_eager_sharding(False):
            return Transformer(cfg, mesh=None, rngs=_ShapeOnlyRngs())

    params = nnx.state(nnx.eval_shape(make_model), nnx.Param)
    infos = []
    for name, var in ParamCodec(params).variables.items():
        value = var.get_value()
        names = sharding.variable_names(var) or (None,) * len(value.shape)
        infos.append(ParamInfo(name=name, shape=tuple(int(d) for d in value.shape),
                               dtype=jax.numpy.dtype(value.dtype).name, axes=tuple(names)))
    return tuple(infos)


@functools.lru_cache(maxsize=65536)
def shard_ways(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: tuple[tuple[str, int], ...],
               fsdp: bool) -> int:
    """How many ways trainer.sharding splits an array with these logical axes on a mesh of this shape
    (`(("data", D), ("expert", E))`): the number of distinct shards, so its bytes per device are
    nbytes / shard_ways."""
    import jax

    from trainer import sharding

    mesh = jax.sharding.AbstractMesh(tuple(n for _, n in mesh_shape), tuple(a for a, _ in mesh_shape))
    spec = sharding.logical_to_spec(axes, shape, mesh, fsdp)
    sizes: Mapping[str, int] = dict(mesh_shape)
    ways = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            ways *= sizes[axis]
    return ways
