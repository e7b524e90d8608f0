"""Which weights serving quantizes and how: the layouts trainer/serve/quant.py (int8), quant4.py (int4) and
mxfp4.py (MXFP4) cut, and the serving memory's constants (trainer/serve/memory.py), jax-free for the planner's
`plan --serve`.

int8: per output channel, symmetric, one float32 scale per channel (the input axes reduced). int4: each output
channel's last input axis cut into groups of GROUP values (or the largest power of two dividing both), each
with a float32 scale, two values a byte. mxfp4: the routed experts' weights only, as GPT-OSS's Hub checkpoints
hold them: FP4 (e2m1) values, two a byte, and a power-of-two scale (one byte) a block of MXFP4_BLOCK values
along the input axis, MXFP4_BITS bits a weight; every other weight stays in the checkpoint's float dtype.
"""

from __future__ import annotations

import math

from trainer.stacks import is_stacked

# The weight formats the engine quantizes to on load (`--weights`); `auto` keeps the checkpoint's float dtype.
# The one list: the server's flag and the planner's serve verdict read it.
QUANTIZED_WEIGHTS = ("int8", "int4", "mxfp4")

# Beyond weights and cache: logits, activations of a prefill chunk, XLA's scratch. A share of the device
# memory, since what it covers grows with the model.
HEADROOM = 0.10

# Kept in float whatever their rank: the router and the norms, and every bias and attention sink (small, and
# added to the products as they are: a rounded bias shifts every token's output alike).
FLOAT_LEAVES = ("router", "scale", "router_bias", "sinks", "bq", "bk", "bv", "bo", "b_in", "b_gate", "b_out")

GROUP = 128  # int4's values a scale, where the input axis allows (group_size)

MXFP4_BLOCK = 32  # MXFP4's values a scale, along the input axis
MXFP4_SCALE_BIAS = 127  # a scale byte s stands for 2^(s - 127)
MXFP4_BITS = 4 + 8 / MXFP4_BLOCK  # a weight's bits: its FP4 value and its share of its block's scale byte
EXPERT_LEAVES = ("w_in", "w_gate", "w_out")  # the routed experts' weights [experts, in, out] (and a dense FFN's)


def input_axes(name: str, ndim: int) -> tuple[int, ...] | None:
    """The axes a weight contracts over (reduced for its scale), or None: kept in float."""
    leaf = name.rsplit(".", 1)[-1]
    if is_stacked(name):  # the stacked layers' weight [layers, ...] (trainer/stacks.py): its layers' axes, one on
        axes = input_axes(leaf, ndim - 1)
        return None if axes is None else tuple(a + 1 for a in axes)
    if ndim < 2 or leaf in FLOAT_LEAVES:
        return None
    if leaf == "embed":  # [V, D]: a row per token, and the tied head's output channel
        return (1,)
    if leaf == "wo":  # [N, H, D]
        return (0, 1)
    if ndim == 3 and leaf in EXPERT_LEAVES:  # routed experts [E, in, out]
        return (1,)
    return (0,)


def group_axis(name: str, shape: tuple[int, ...]) -> int | None:
    """The input axis a weight's int4 groups run along (the last it contracts over), or None: kept in float
    (the router, the norms, and a weight whose input axis has an odd length, which cannot be packed)."""
    axes = input_axes(name, len(shape))
    if axes is None or shape[axes[-1]] % 2:
        return None
    return axes[-1]


def group_size(length: int) -> int:
    """The values a scale covers along an input axis of `length` (even): GROUP, or the largest power of
    two dividing both."""
    return math.gcd(length, GROUP)


def layout(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the packed values' shape, the scales' shape) of a weight of `shape` grouped along `axis`."""
    length = shape[axis]
    packed = (*shape[:axis], length // 2, *shape[axis + 1:])
    return packed, (*shape[:axis], length // group_size(length), *shape[axis + 1:])


def is_routed_expert(name: str, ndim: int) -> bool:
    """Whether weight `name` of `ndim` axes is a routed experts' weight, [experts, in, out] (stacked: [layers,
    experts, in, out]); a dense FFN's weights go by the same names with one axis fewer."""
    return name.rsplit(".", 1)[-1] in EXPERT_LEAVES and ndim - is_stacked(name) == 3


def mxfp4_axis(name: str, shape: tuple[int, ...]) -> int | None:
    """The input axis a routed experts' weight's MXFP4 blocks run along, or None: kept in float (every weight
    but the routed experts'). ValueError where that axis is not a whole number of blocks."""
    if not is_routed_expert(name, len(shape)):
        return None
    axis = len(shape) - 2
    if shape[axis] % MXFP4_BLOCK:
        raise ValueError(f"--weights mxfp4: {name} {list(shape)} has {shape[axis]} inputs an output, not a multiple "
                         f"of MXFP4's blocks of {MXFP4_BLOCK}; serve it with --weights int4, int8 or auto")
    return axis
