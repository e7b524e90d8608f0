"""How the mesh splits an array by the logical names of its axes: the rules trainer/sharding.py applies to the
device mesh, as plain tuples, so that the planner counts each chip's shard without jax.

Layers name their parameter axes ("embed", "mlp", "vocab", "heads", "kv", "expert", ...); the rules map those
names to the mesh axes "data", "expert" and "model". An axis the mesh cannot divide stays whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

BATCH_AXES = ("data", "expert")

# Logical name -> mesh axis (or axes, or None: replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "expert": "expert",
    "embed": None,
    "mlp": "model",
    "vocab": None,
    # The vocabulary when `train.shard_vocab` is set: the model names its vocabulary axis so (vocab_axis),
    # and every reader of the rules (parameters, optimiser state, serving, the planner) follows.
    "sharded_vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "kv": None,
    "norm": None,
    "length": None,
    "layers": None,  # the stacked layers' leading axis (trainer/stacks.py): each device holds every layer
}
FSDP_RULES = {**RULES, "embed": "data"}

Entry = str | tuple[str, ...] | None  # one axis's entry of a partition spec


def rules(fsdp: bool) -> dict[str, str | tuple[str, ...] | None]:
    return FSDP_RULES if fsdp else RULES


def spec_entries(names: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int],
                 fsdp: bool = False) -> tuple[Entry, ...]:
    """Each axis's mesh axes (a partition spec's entries) for an array with logical axis `names` on a mesh of
    `mesh_shape` ({"data": D, "expert": E, "model": T}); a dim the mesh cannot divide stays whole (None)."""
    table = rules(fsdp)
    used: set[str] = set()
    spec: list[Entry] = []
    for name, size in zip(names, shape, strict=True):
        axes = table.get(name) if name is not None else None
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if axes_t and not used.intersection(axes_t):
            ways = math.prod(mesh_shape.get(a, 1) for a in axes_t)
            if ways > 1 and size % ways == 0:
                spec.append(axes_t[0] if len(axes_t) == 1 else axes_t)
                used.update(axes_t)
                continue
        spec.append(None)
    return tuple(spec)


@functools.lru_cache(maxsize=65536)
def shard_ways(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: tuple[tuple[str, int], ...],
               fsdp: bool) -> int:
    """How many ways the rules split an array with these logical axes on a mesh of this shape
    (`(("data", D), ("expert", E))`): the number of distinct shards, so its bytes per device are
    nbytes / shard_ways."""
    sizes = dict(mesh_shape)
    ways = 1
    for entry in spec_entries(axes, shape, sizes, fsdp):
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            ways *= sizes[axis]
    return ways
