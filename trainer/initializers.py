"""The parameters' random initial values, drawn so that their TPU program compiles in a fraction of a second.

Each initializer is `init(key, shape, dtype, names=None)` (jax's signature, plus the parameter's logical axis
names) and gives what its jax namesake gives in distribution: a normal, or one truncated to two standard
deviations (`truncated_normal`, `variance_scaling`'s "fan_in" for `lecun`), in float32, then cast. The values
are another stream than jax.random's: element (i0, rest) of an array is threefry2x32(key, (i0, the flat index
of `rest` in shape[1:])), so that a value depends on the key and its place only.

Why: the initial state's program is all random draws, and XLA's TPU compiler lowers each draw (threefry's
twenty rounds and the inverse error function, fused) into a kernel whose body it unrolls over a window that
grows with the array: moe-1b's 17 draws (embedding, head, six layers of attention, dense FFN and 16 experts of
1,024 x 2,816) took 19 s of CPU to compile for one v5e chip (28-29 s on the chip's host), 56 s drawn whole
outside the layer loop, against 0.7 s with no draws at all. Drawn flat (jax.random with a 1-D shape: the same
values) 7 s. Here a large draw is a loop (jax.lax.map) over slabs of at most SLAB elements, each slab
computing its own elements' counters, so each kernel is small: the trainer's program 5.9 s of CPU, the
serving engine's 5.4 (benchmarks/init_compile.py; about 13 draws left at 0.3 to 0.6 s each). The loop runs
over leading axes the mesh leaves whole (`sharding.logical_mesh`: a loop over a split axis would make every
device draw every slab); where the first axis is split, the array is drawn whole, each device its own shard,
as jax.random's partitionable threefry does. The values depend on neither the slabs nor the mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from trainer import sharding
from trainer.arith.mesh import spec_entries

SLAB = 1 << 21  # elements a loop step draws: moe-1b's experts go in slabs of 512 x 2,816
Init = Callable[..., jax.Array]  # init(key, shape, dtype, names=None)
_LECUN_CORRECTION = 0.87962566103423978  # the standard deviation of a unit normal truncated to [-2, 2]
_SHAPES_ONLY = contextvars.ContextVar("moe_tpu_init_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Meanwhile every draw is zeros of its shape and dtype: for a model built only for its shapes (under
    eval_shape, or for state that holds no parameter), where tracing the draws cost 6-10 times the rest of
    the build (`plan` of deepseek-v3-671b 3.5 -> 0.55 s of CPU). Never around a function that is jitted again
    outside it: jax reuses a function's traced program for the same argument shapes, whatever this says."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def truncated_normal(stddev: float = 1.0) -> Init:
    """stddev times a unit normal truncated to [-2, 2] (jax.nn.initializers.truncated_normal's)."""
    return lambda key, shape, dtype, names=None: _draw(key, shape, dtype, names, stddev, 2.0)


def normal(stddev: float = 1.0) -> Init:
    return lambda key, shape, dtype, names=None: _draw(key, shape, dtype, names, stddev, None)


def variance_scaling(in_axis: int | Sequence[int] = -2, out_axis: int | Sequence[int] = -1) -> Init:
    """jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis, out_axis)'s."""
    def init(key, shape, dtype, names=None):
        fan_in = _fan_in(tuple(shape), in_axis, out_axis)
        return _draw(key, shape, dtype, names, math.sqrt(1.0 / fan_in) / _LECUN_CORRECTION, 2.0)

    return init


def zeros(key, shape, dtype, names=None) -> jax.Array:
    return jnp.zeros(shape, dtype)


lecun = variance_scaling()


def _fan_in(shape: tuple[int, ...], in_axis, out_axis) -> int:
    axes = lambda a: tuple(i % len(shape) for i in ((a,) if isinstance(a, int) else a))  # noqa: E731
    ins, outs = axes(in_axis), axes(out_axis)
    receptive = math.prod(d for i, d in enumerate(shape) if i not in ins + outs)
    return math.prod(shape[i] for i in ins) * receptive


def _draw(key, shape, dtype, names, stddev: float, bound: float | None) -> jax.Array:
    shape = tuple(int(d) for d in shape)
    if _SHAPES_ONLY.get():
        return jnp.zeros(shape, dtype)
    if math.prod(shape[1:]) >= 2**32:  # rows past the 32-bit counters (8 GB a row in bfloat16): jax's own draw
        z = jax.random.normal(key, shape) if bound is None else jax.random.truncated_normal(key, -bound, bound, shape)
        return (z * stddev).astype(dtype)
    k1, k2 = jax.random.bits(key, (2,), jnp.uint32)
    lo, hi = (-1.0, 1.0) if bound is None else (math.erf(-bound / math.sqrt(2)), math.erf(bound / math.sqrt(2)))

    def values(step, view, axes, block):
        u_01 = _uniform(k1, k2, _counters(shape, view, axes, block, step))
        z = math.sqrt(2) * jax.lax.erf_inv(lo + (hi - lo) * u_01)
        return ((z if bound is None else jnp.clip(z, -bound, bound)) * stddev).astype(dtype)

    axes, block = _slabs(shape, names)
    if axes == 0:
        return values(None, shape, 0, 0)
    steps = math.prod(shape[:axes]) // block
    view = (block, *shape[axes:])
    out = jax.lax.map(lambda step: values(step, view, axes, block), jnp.arange(steps, dtype=jnp.uint32))
    return out.reshape(shape)


def _uniform(k1, k2, counters) -> jax.Array:
    """float32 in (0, 1), 23 bits of threefry's hash of the counters (hi, lo) under the key (k1, k2)."""
    bits1, bits2 = threefry2x32_p.bind(k1, k2, *counters)
    mantissa = ((bits1 ^ bits2) >> 9).astype(jnp.float32)
    return (mantissa + 0.5) * np.float32(2.0**-23)


def _counters(shape, view, axes: int, block: int, step) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) of each element of `view`: its index along shape's first axis and its flat index in
    shape[1:]. `view` is the whole array (axes 0) or loop step `step`'s slab: rows step * block ... of
    shape's first `axes` axes taken as one, and the axes after them whole."""
    u32 = jnp.uint32
    inner = math.prod(shape[axes:])
    rest = sum((jax.lax.broadcasted_iota(u32, view, d) * u32(math.prod(view[d + 1:])) for d in range(1, len(view))),
               jnp.zeros(view, u32))
    if axes == 0:
        first = jax.lax.broadcasted_iota(u32, view, 0) if view else jnp.zeros(view, u32)
        return first, rest
    row = step * u32(block) + jax.lax.broadcasted_iota(u32, view, 0)  # among the first `axes` axes taken as one
    per_first = math.prod(shape[1:axes])
    return row // u32(per_first), (row % u32(per_first)) * u32(inner) + rest


def _slabs(shape: tuple[int, ...], names) -> tuple[int, int]:
    """(how many leading axes the loop runs over, taken as one; the rows of them a step draws), (0, 0) for
    no loop: the fewest leading axes whose rest fits in SLAB, of those the mesh leaves whole."""
    if math.prod(shape) <= SLAB:
        return 0, 0
    whole = _whole_axes(shape, names)
    for axes in range(1, whole + 1):
        rest = math.prod(shape[axes:])
        if rest <= SLAB or axes == whole:
            rows = math.prod(shape[:axes])
            block = max((d for d in _divisors(rows) if d * rest <= SLAB), default=1)
            return axes, block
    return 0, 0


def _whole_axes(shape: tuple[int, ...], names) -> int:
    """How many leading axes no device's shard cuts, on the current `sharding.logical_mesh` (none: all).
    `embed` counts as split over `data` as FSDP splits it, whether or not the run uses FSDP."""
    mesh = sharding.current_mesh()
    if mesh is None:
        return len(shape)
    if names is None:  # replicated
        return len(shape)
    spec = spec_entries(tuple(names), shape, dict(mesh.shape), fsdp=True)
    return next((i for i, entry in enumerate(spec) if entry is not None), len(shape))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]
