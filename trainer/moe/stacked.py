"""One layer of a stacked expert weight, held as the whole stack and the layer's index (LayerOf): what the
serving steps hand the grouped matmul.

The layers run in a scan over stacked weights ([layers, experts, in, out], trainer/stacks.py). A scan step's
slice of a weight is a dynamic slice, which XLA fuses into its own matmuls but writes out whole before a
custom call such as a grouped-matmul kernel: compiled for a v5e chip, moe-1b's decode program copied each
MoE layer's three expert weights (92 MB each, all 16 experts) to read the two a token routes to, and an
int8 or int4 weight was widened to a float copy first (benchmarks/serve_aot.py counts these copies).

A LayerOf keeps the stack whole. The grouped matmul (trainer/moe/gmm.py) reads it as one weight of
[layers * experts] groups whose groups outside the layer hold no rows, so the kernel fetches only the
experts the step's tokens route to, straight from the stack, and a quantized stack as its integers and
scales (tokamax's ragged dot takes them as a qwix QArray and widens each tile inside the kernel; an int4 stack
goes to gmm.int4_grouped_matmul, which reads its scales as held). Every other
reader (the CPU's tiled loop, the batched capacity path, an expert-parallel shard_map) takes `read()`: the
layer's slice as the scan would have handed it, so what a step computes is the same either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")  # the routed experts' weights of an MoE layer (trainer/moe/layer.py)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerOf:
    stack: Any  # [layers, experts, in, out]: an array, or an int8/int4/MXFP4 weight of that shape (trainer/serve/)
    index: jax.Array  # int32 scalar: the layer's row of the stack
    dtype: str | None = dataclasses.field(metadata={"static": True}, default=None)  # read()'s dtype (None: as held)

    @property
    def shape(self) -> tuple[int, ...]:
        """The layer's weight's shape, [experts, in, out]."""
        return stack_shape(self.stack)[1:]

    def astype(self, dtype) -> LayerOf:
        """The same layer, read as `dtype` (the stack itself is never converted whole)."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype).name)

    def read(self) -> jax.Array:
        """The layer's weight as the layer would read its own slice (widened, in `dtype`)."""
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, keepdims=False), self.stack)
        value = layer if isinstance(layer, jax.Array) else layer[...]
        return value if self.dtype is None else value.astype(self.dtype)

    def groups(self):
        """(the stack as one weight of [layers * experts] groups, [G, in, out]; the scales to multiply each output
        row by, [G, out], or None). A float stack is itself; an int8 stack (a scale an output channel) its
        integers, its scales applied after the product, row by row; an int4 stack in jnp.int4 (a scale a group
        of inputs) or an MXFP4 stack (FP4 values, a power of two a block of 32 inputs) a qwix QArray, widened
        tile by tile inside the kernel. None for int4 packed as nibbles, which no grouped kernel takes."""
        import qwix

        layers, experts = stack_shape(self.stack)[:2]

        def flat(a):
            return a.reshape(layers * experts, *a.shape[2:])

        if isinstance(self.stack, jax.Array):
            return flat(self.stack), None
        values, scale = getattr(self.stack, "values", None), getattr(self.stack, "scale", None)
        if values is None:
            return None
        if hasattr(self.stack, "factors"):  # MXFP4: its scale bytes as the powers of two they stand for (exact)
            return qwix.QArray(flat(values), flat(self.stack.factors()).astype(jnp.bfloat16)), None
        if scale.shape[-2] == 1:  # int8: one scale an output channel, [layers, experts, 1, out]
            return flat(values), flat(scale)[:, 0]
        # int4: the scales as held (float32, one a group of inputs); the grouped matmul rounds them to bfloat16
        # where it multiplies, and on a TPU reads them in this shape (gmm.py int4_grouped_matmul says why)
        return qwix.QArray(flat(values), flat(scale)), None

    def held(self):
        """The layer's slice as held (an array, or an int8/int4/MXFP4 weight of [experts, in, out]), not widened:
        what the scan would have handed the layer."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, keepdims=False), self.stack)

    def group_offset(self) -> jax.Array:
        """The layer's first group in groups()."""
        return self.index * stack_shape(self.stack)[1]


def stack_shape(stack) -> tuple[int, ...]:
    """The shape of the weight a stack holds (an int4 nibble stack holds two values a byte along its groups)."""
    if isinstance(stack, jax.Array | jax.ShapeDtypeStruct):
        return tuple(stack.shape)
    values = getattr(stack, "values", None)
    if values is not None:
        return tuple(values.shape)
    packed, axis = stack.packed.shape, stack.axis % stack.packed.ndim
    return (*packed[:axis], 2 * packed[axis], *packed[axis + 1:])


def read(w):
    """A weight as an array: a LayerOf's layer read, anything else as it is."""
    return w.read() if isinstance(w, LayerOf) else w


def is_expert_stack(path: tuple[str, ...], value) -> bool:
    """Whether the parameter at `path` (within a stack's blocks) holding `value` is a routed experts' stacked
    weight, [layers, experts, in, out] (a dense FFN's weights go by the same names, one axis fewer)."""
    return len(path) >= 2 and path[-2] == "ffn" and path[-1] in EXPERT_WEIGHTS and len(stack_shape(value)) == 4


def is_dense_quantized_stack(path: tuple[str, ...], value) -> bool:
    """Whether the parameter at `path` holding `value` is a dense FFN's stacked weight, [layers, in, out], held
    quantized (int8 or int4: a float one's slice XLA fuses into its product as it is). Kept whole for the same
    reason as the experts': on a v5e chip XLA copied each int4 layer's slice out of the stack before its
    product (moe-1b's three dense FFN weights, 60 us of a 0.53 ms decode step at one slot, 2026-12-07,
    benchmarks/serve_weights.py --profile), where stacked_rows_product reads it in place (DenseFFN)."""
    return (len(path) >= 2 and path[-2] == "ffn" and path[-1] in EXPERT_WEIGHTS
            and not isinstance(value, jax.Array) and len(stack_shape(value)) == 3)


def path_names(path) -> tuple[str, ...]:
    """A pytree key path as plain names: ("0", "ffn", "w_in")."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def split_stacks(params, repeats: int):
    """(params with each routed experts' weight, and each dense FFN's quantized one, replaced by a [repeats]
    placeholder the layer scan slices for nothing, {path: the whole stacked weight}); `params` is an nnx.State
    of a stack's blocks. A dense FFN's stack is kept as [layers, 1, in, out]: one expert a layer (a new
    leading axis of one, which moves no bytes)."""
    from flax import nnx

    whole = {}

    def apart(path, var):
        names = path_names(path)
        if not isinstance(var, nnx.Variable):
            return var
        value = var.get_value()
        if is_expert_stack(names, value):
            whole[names] = value
        elif is_dense_quantized_stack(names, value):
            whole[names] = jax.tree.map(lambda a: a[:, None], value)
        else:
            return var
        return var.replace(jnp.zeros((repeats,), jnp.int8))

    kept = jax.tree_util.tree_map_with_path(apart, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return kept, whole


def with_layer(layer_params, whole: dict, index: jax.Array):
    """A scan step's parameters with each routed experts' weight put back as LayerOf(its whole stack, index)."""
    from flax import nnx

    def back(path, var):
        names = path_names(path)
        if not isinstance(var, nnx.Variable) or names not in whole:
            return var
        return var.replace(LayerOf(whole[names], index))

    return jax.tree_util.tree_map_with_path(back, layer_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
