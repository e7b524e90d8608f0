"""A serving step's few assignments, each through its expert's weights read directly: no sort by expert, no
grouped-matmul kernel.

A decode step of one slot has top_k assignments. The grouped path (core.dropless_moe) sorts them by expert,
lays their rows out in blocks, pads them to the kernel's 128 rows and runs three grouped-matmul kernels over
the layer's experts, then gathers the rows back: on a v5e chip each kernel cost 15-21 us at one slot where its
experts' bytes take 4-14 us, and the sort and layout were most of the step's ~300 small ops. Here each
assignment's three products read their expert's slice of the weight (from the whole stack where the layer
holds it, trainer/moe/stacked.py: a dynamic slice that XLA fuses into the product, so only that expert's
bytes are read), and the outputs are summed by their gates. An assignment reads its expert once, so past a
few assignments (two tokens routed to the same expert read it twice) the grouped path wins:
MoEConfig.direct_assignments sets where the one gives way to the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.moe.stacked import LayerOf


def direct_fits(assignments: int, limit: int, train: bool, sharded: bool) -> bool:
    """Whether a step of `assignments` (tokens x top_k) on one device's experts takes the direct path: in
    serving (never in training, whose backward pass wants the grouped layout) and at most `limit` of them."""
    return not train and not sharded and 0 < assignments <= limit


def expert_of(w, expert: jax.Array):
    """Expert `expert`'s 2-D weight as held: its slice of a LayerOf's whole stack (an array, or an int8/int4/MXFP4
    weight of the same kind), or of an [experts, ...] array."""
    if isinstance(w, LayerOf):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
            jax.lax.dynamic_index_in_dim(a, w.index, 0, keepdims=False), expert, 0, keepdims=False), w.stack)
    return jax.lax.dynamic_index_in_dim(w, expert, 0, keepdims=False)


def direct_ffn(x_TxD: jax.Array, experts_TxK: jax.Array, gates_TxK: jax.Array, w, products: str = "xla") -> jax.Array:
    """sum_k gate[t, k] * expert[t, k]'s FFN of x[t], float32 [T, D]; `w` an ExpertWeights whose weights are arrays
    or LayerOfs. Each product runs over the step's T x K assignments (few, by direct_fits), one expert each,
    `products` as MoEConfig.direct_products says (kernel_operands)."""
    tokens, k = experts_TxK.shape
    dtype = x_TxD.dtype
    experts_A = experts_TxK.reshape(-1)
    x_AxD = jnp.repeat(x_TxD, k, axis=0)  # each token's row once an assignment, in the order of experts_A
    h_AxF = product(x_AxD, w.w_in_ExDxF, experts_A, dtype, products)
    g_AxF = product(x_AxD, w.w_gate_ExDxF, experts_A, dtype, products)
    if w.biased:
        h_AxF, g_AxF = h_AxF + w.b_in_ExF[experts_A], g_AxF + w.b_gate_ExF[experts_A]
    out_AxD = product(w.activation(g_AxF, h_AxF), w.w_out_ExFxD, experts_A, dtype, products)
    if w.biased:
        out_AxD = out_AxD + w.b_out_ExD[experts_A]
    weighted = gates_TxK.reshape(-1, 1).astype(jnp.float32) * out_AxD.astype(jnp.float32)
    return jnp.sum(weighted.reshape(tokens, k, -1), axis=1)


def kernel_operands(w, products: str):
    """(values [layers * experts, in, out], scales [layers * experts, groups, out] float32) where a weight's
    direct products go through stacked_rows_product, else None. "kernel": a LayerOf's int8 stack (groups 1, a
    scale an output channel) or int4 stack (a scale a group of inputs, each whole lane tiles of them), as
    LayerOf.groups holds them; "auto": both on a TPU. Measured on a v5e chip (moe-1b at one slot,
    benchmarks/serve_weights.py --variant moe.direct_products=kernel --variant moe.direct_products=xla):
    XLA copies each int4 expert's slice out of the stack before its product (2026-12-06: the decode program
    0.681 ms, the kernel's 0.618); an int8 slice it reads in place, a step as fast as the kernel (0.709 and
    0.704 ms), but a lone stream's burst of 8 steps ran 0.656 ms a step through the kernel against
    0.688-0.696 through XLA (three calls, 2026-12-06/07). Floats (whose sliced product XLA fuses as it is),
    int4 nibbles and MXFP4 never."""
    from trainer.sharding import current_platform

    if products == "xla" or not isinstance(w, LayerOf) or (held := w.groups()) is None:
        return None
    groups, row_scales_GxN = held
    if products == "auto" and current_platform() != "tpu":
        return None
    if row_scales_GxN is not None:  # int8
        return groups, row_scales_GxN[:, None, :].astype(jnp.float32)
    values, scale = getattr(groups, "qvalue", None), getattr(groups, "scale", None)
    if values is None or values.dtype != jnp.int4 or (values.shape[-2] // scale.shape[-2]) % 128:
        return None  # floats, MXFP4, int4 groups narrower than a lane tile
    return values, scale.astype(jnp.float32)


def product(x_AxK: jax.Array, w, experts_A: jax.Array, dtype, products: str) -> jax.Array:
    """Each assignment's row times its expert's weight, [A, N] in `dtype`: through stacked_rows_product where
    kernel_operands gives its operands, else one product a row, XLA's, of the expert's slice as held
    (trainer.layers.times)."""
    from trainer.layers import times

    operands = kernel_operands(w, products)
    if operands is not None:
        from trainer.sharding import current_platform

        rows = jnp.pad(x_AxK.astype(dtype)[:, None, :], ((0, 0), (0, KERNEL_ROWS - 1), (0, 0)))
        out = stacked_rows_product(rows, *operands, w.group_offset() + experts_A,
                                   interpret=current_platform() != "tpu")
        return out[:, 0].astype(dtype)
    return jnp.concatenate([times(x_AxK[a:a + 1], expert_of(w, experts_A[a]), dtype)
                            for a in range(x_AxK.shape[0])])


KERNEL_ROWS = 8  # a row padded to a vector register's sublanes: the kernel's product stays a matrix product
LAYER_ROWS = 64  # layer_product's rows through the kernel at most (a decode step's; a prefill chunk's go to XLA)


def layer_product(x: jax.Array, w: LayerOf, dtype, products: str) -> jax.Array:
    """x @ a dense layer's weight held as its whole quantized stack (trainer/moe/stacked.py split_stacks: a
    LayerOf of [layers, 1, in, out]), in `dtype`: through stacked_rows_product, reading the layer's tiles in
    place, where kernel_operands gives its operands, the step has at most LAYER_ROWS rows and one device holds
    the weight; else XLA's product of the layer's slice as held (trainer.layers.times), as the scan would
    have handed it."""
    import math

    from trainer.layers import times
    from trainer.sharding import current_platform, on_one_device

    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    operands = kernel_operands(w, products) if rows <= LAYER_ROWS and on_one_device() else None
    if operands is None:
        return times(x, jax.tree.map(lambda a: a[0], w.held()), dtype)
    padded = -(-rows // KERNEL_ROWS) * KERNEL_ROWS
    x_1xRxK = jnp.pad(x.astype(dtype).reshape(1, rows, k), ((0, 0), (0, padded - rows), (0, 0)))
    out = stacked_rows_product(x_1xRxK, *operands, w.group_offset()[None], interpret=current_platform() != "tpu")
    return out[0, :rows].reshape(*x.shape[:-1], -1).astype(dtype)


def stacked_rows_product(x_AxRxK: jax.Array, values_GxKxN: jax.Array, scale_GxCxN: jax.Array, groups_A: jax.Array,
                         interpret: bool = False, columns: int | None = None) -> jax.Array:
    """float32 out[a] = x[a] @ (values[groups[a]] times its scales), the scales along the K inputs (C of them, one
    a K / C inputs; C = 1: one an output channel, applied to the sum). A Pallas kernel for the TPU: each
    assignment's tiles of its group's weight read straight from the stack, widened in VMEM.

    Why by hand: XLA reads an int8 expert's slice of the stack inside its product, but copies an int4 slice out
    of the stack before each product (on a v5e chip, 2026-12-06: 81 us of moe-1b's 0.58 ms decode program at one
    slot, benchmarks/serve_weights.py --profile); the grouped-matmul kernels (gmm.py) need group metadata and
    rows sorted by group, which is the work a few assignments should not pay for."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    assignments, rows, k = x_AxRxK.shape
    _, groups, n = scale_GxCxN.shape
    tn = column_tile(k, n) if columns is None else min(n, columns)  # columns: a benchmark's tile (rows_product.py)
    call = pl.pallas_call(
        _rows_kernel(k // groups, groups),
        out_shape=jax.ShapeDtypeStruct((assignments, rows, n), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            in_specs=[pl.BlockSpec((None, rows, k), lambda a, j, g: (a, 0, 0)),
                      pl.BlockSpec((None, k, tn), lambda a, j, g: (g[a], 0, j)),
                      pl.BlockSpec((None, groups, tn), lambda a, j, g: (g[a], 0, j))],
            out_specs=pl.BlockSpec((None, rows, tn), lambda a, j, g: (a, 0, j)),
            grid=(assignments, pl.cdiv(n, tn)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="stacked_rows_product",
    )
    return call(groups_A.astype(jnp.int32), x_AxRxK, values_GxKxN, scale_GxCxN)


TILE_VALUES = 2 * 1024 * 1024  # a weight's tile at most: 1 MB of int4, double-buffered well inside VMEM


def column_tile(k: int, n: int) -> int:
    """stacked_rows_product's tile of output columns for a weight of k inputs (the whole contraction a tile: no
    ragged last tile of inputs): the widest lane multiple dividing n whose tile holds at most TILE_VALUES, so
    no tile is ragged either (moe-1b's 2,816-wide experts: two tiles of 1,408, not 1,024, 1,024 and 768);
    where none divides, 1,024 columns (512 past 1,024 inputs) and a ragged last tile."""
    fits = [t for t in range(128, n + 1, 128) if n % t == 0 and k * t <= TILE_VALUES]
    return max(fits) if fits else min(n, 1024 if k <= 1024 else 512)


def _rows_kernel(step: int, groups: int):
    """stacked_rows_product's body for one (assignment, tile of columns): the rows times the tile, a group of
    `step` inputs at a time, each partial product times its group's scales (one group: the scales after)."""

    def kernel(groups_ref, x_ref, q_ref, s_ref, out_ref):
        if groups == 1:
            product = jax.lax.dot_general(x_ref[...], q_ref[...].astype(x_ref.dtype), (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
            out_ref[...] = product * s_ref[...]
            return
        total = jnp.zeros(out_ref.shape, jnp.float32)
        for j in range(groups):
            inputs = slice(j * step, (j + 1) * step)
            # the int4 operand as it is: Mosaic widens it on the way into the product (gmm.int4_grouped_matmul)
            part = jax.lax.dot_general(x_ref[:, inputs], q_ref[inputs, :], (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
            total = total + part * s_ref[j:j + 1, :]
        out_ref[...] = total

    return kernel
