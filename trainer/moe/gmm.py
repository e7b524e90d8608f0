"""Grouped matmul over expert-sorted rows (the TPU/GPU dropless path): jax.lax.ragged_dot, or the megablox
kernel (jax's own Pallas grouped matmul for TPUs, `jax.experimental.pallas.ops.tpu.megablox`), whose tiles
are chosen for the v5e here; on a CPU megablox runs through Pallas' interpreter (tests only).

Rows come in the block layout of dispatch.aligned_layout: groups start on
multiples of B rows and the blocks in use come first. On CPU ragged_dot lowers
to a masked dense product costing rows * experts, so there the whole FFN runs
as a loop over the blocks in use instead (tiled.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trainer.moe.stacked import LayerOf


def grouped_matmul(x_MxK: jax.Array, w_GxKxN: jax.Array, block_group_NB: jax.Array, num_blocks: jax.Array,
                   impl: str = "ragged_dot") -> jax.Array:
    """out[m] = x[m] @ w[group of m] for rows in the used blocks, zeros elsewhere."""
    block_rows = x_MxK.shape[0] // block_group_NB.shape[0]
    num_groups = w_GxKxN.shape[0]
    sizes_G = jnp.zeros((num_groups,), jnp.int32).at[block_group_NB].add(
        jnp.where(jnp.arange(block_group_NB.shape[0]) < num_blocks, block_rows, 0)
    )
    if isinstance(w_GxKxN, LayerOf):
        out = stacked_matmul(x_MxK, w_GxKxN, sizes_G)
        if out is not None:
            return out
        w_GxKxN = w_GxKxN.read()
    # Rows past the used blocks are zeros; give them to the last group so every row is in one.
    sizes_G = sizes_G.at[-1].add(x_MxK.shape[0] - jnp.sum(sizes_G))
    # bfloat16 operands' products are exact in float32 at any precision, so one pass is stated for them: under
    # jax.default_matmul_precision('highest') the TPU's grouped-matmul kernel (Mosaic) refuses float32 contract
    # precision on bfloat16 operands. float32 operands keep the context's precision.
    if impl == "megablox":
        return _megablox(x_MxK, w_GxKxN, sizes_G)
    bf16 = x_MxK.dtype == jnp.bfloat16 and w_GxKxN.dtype == jnp.bfloat16
    precision = jax.lax.Precision.DEFAULT if bf16 else None
    out = jax.lax.ragged_dot(x_MxK, w_GxKxN, sizes_G, precision=precision, preferred_element_type=jnp.float32)
    return out.astype(x_MxK.dtype)


def tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox's (rows, contraction, columns) tile for an [m, k] x [k, n] grouped product: rows the largest
    of 512, 256 and 128 that divides m; 1,024 of the contraction and 512 columns (the kernel masks a ragged
    last tile), or the whole dimension where it is smaller. Measured on a v5e chip (2026-12-06,
    benchmarks/train_levers.py, rows 32,768 x 1,024 x 2,816 over 16 experts, forward and backward):
    (512, 1024, 512) ran at 101 TFLOP/s against ragged_dot's 81; (128, 128, 128) at 10; (512, 1024, 1024)
    ran out of VMEM in the backward kernel."""
    rows = next((t for t in (512, 256, 128) if m % t == 0), m)
    return rows, min(k, 1024), min(n, 512)


def _megablox(x_MxK: jax.Array, w_GxKxN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    from trainer.sharding import current_platform

    m, k = x_MxK.shape
    interpret = current_platform() != "tpu"
    # The kernel sums in float32 and writes the rows' dtype: the same values as a float32 product rounded after
    # it, without a float32 copy of every row written and read again; its gradient then comes in that dtype too
    # (values a bfloat16 held anyway; on a CPU the backward product sums them in another order, an ulp apart at
    # a few elements). On a v5e chip moe-1b's dropless step wrote float32 [33,792, 2,816] products and read
    # them back in a separate pass for the gated activation: 17 ms a step forward, 8 ms backward.
    return gmm(x_MxK, w_GxKxN, sizes_G, x_MxK.dtype, tiling(m, k, w_GxKxN.shape[2]), None, None, False, interpret)


MAX_ROW_TILES = 4  # a decode step's tiles of rows at most (stacked_tiling)
MIN_KERNEL_ROWS = 128  # tokamax's Mosaic grouped matmul refuses fewer rows (or contraction, or columns)


def stacked_matmul(x_MxK: jax.Array, w: LayerOf, sizes_G: jax.Array) -> jax.Array | None:
    """x @ w's layer, grouped by `sizes_G` (the layer's experts), read from the whole stack by tokamax's ragged
    dot: the stack is one weight of [layers * experts] groups (LayerOf.groups) and the other layers' groups get
    no rows, so a kernel reads only the tiles of the experts rows go to, a quantized stack as integers and
    scales. On a TPU the kernel is tokamax's Mosaic grouped matmul, or for an int4 stack int4_grouped_matmul,
    with tiles for the step's shape (stacked_tiling); elsewhere tokamax's XLA reference (widened weights and a
    masked dense product: tests).
    None where the stack has no grouped form (int4 nibbles) or the kernel takes none (MXFP4 on a TPU): the
    caller reads the layer."""
    import qwix
    import tokamax

    from trainer.sharding import current_platform

    tokamax_without_argv()
    on_tpu = current_platform() == "tpu"
    if on_tpu and hasattr(w.stack, "factors"):
        # MXFP4 on a TPU: the Mosaic kernel hands its FP4 tiles to the matrix unit as they are, and a v5e's
        # takes no FP4 operand (on the chip, 2026-12-06: "Bad lhs/rhs type ... f4E2M1FN"); the caller reads
        # the layer widened instead: exact, at the cost of the widened copy.
        return None
    held = w.groups()
    if held is None:
        return None
    groups, row_scales_GxN = held
    sizes = jax.lax.dynamic_update_slice(jnp.zeros((groups.shape[0],), jnp.int32), sizes_G.astype(jnp.int32),
                                         (w.group_offset(),))
    m = x_MxK.shape[0]
    x = x_MxK if w.dtype is None else x_MxK.astype(w.dtype)
    int4 = isinstance(groups, qwix.QArray) and groups.qvalue.dtype == jnp.int4
    implementation = ["xla"]
    if on_tpu:
        # The kernel takes 128 rows or more; past 512, whole tiles of 512 (stacked_tiling). Padding rows are
        # in no group: no tile of theirs is visited.
        rows = max(MIN_KERNEL_ROWS, m) if m <= 512 else -(-m // 512) * 512
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
        tiles = stacked_tiling(x.shape[0], *groups.shape[1:])
        if int4 and int4_kernel_fits(groups.shape[1], groups.scale.shape[1], tiles[1]):
            out = int4_grouped_matmul(x, groups.qvalue, groups.scale, sizes, tiles)
            return _rows_in_groups(out[:m], sizes_G, x_MxK.dtype)
        implementation = [tpu_ragged_dot(*tiles), "xla"]
    if int4:  # the XLA reference, and tokamax's kernel where ours does not fit, take bfloat16 scales
        groups = qwix.QArray(groups.qvalue, groups.scale.astype(jnp.bfloat16))
    out = tokamax.ragged_dot(x, groups, sizes, preferred_element_type=jnp.float32, implementation=implementation)
    # Rows past the groups (the layout's unused blocks, the padding) are in no group: no expert's tiles are read
    # for them, and the kernel leaves them unwritten.
    rows_M = jnp.arange(m)
    out = out[:m]
    if row_scales_GxN is not None:  # int8: each row times its expert's output-channel scales
        # The row's expert: how many of the layer's groups end at or before it (a compare over the layer's few
        # experts; jnp.searchsorted's loop over all [layers * experts] groups cost more on the chip).
        ends_E = jnp.cumsum(sizes_G.astype(jnp.int32))
        expert_M = jnp.sum(ends_E[None, :] <= rows_M[:, None], axis=1)
        out = out * jnp.take(row_scales_GxN, w.group_offset() + expert_M, axis=0, mode="clip")
    return _rows_in_groups(out, sizes_G, x_MxK.dtype)


def _rows_in_groups(out_MxN: jax.Array, sizes_G: jax.Array, dtype) -> jax.Array:
    """The product's rows in the layer's groups; rows past them, which no kernel writes, as zeros."""
    rows_M = jnp.arange(out_MxN.shape[0])
    return jnp.where((rows_M < jnp.sum(sizes_G))[:, None], out_MxN, 0).astype(dtype)


def tokamax_without_argv() -> None:
    """tokamax reads its options as absl flags and, the first time it reads one, parses sys.argv for them: the
    server's own arguments (`--checkpoint`, `--port`) would stop it with an unknown-flag error. The process uses
    no absl flags of its own, so they are marked parsed as they stand (tokamax's defaults)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def stacked_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(rows, contraction, columns) of a grouped-matmul tile for a decode or prefill step: rows the smallest
    power of two from 8 that leaves at most MAX_ROW_TILES tiles of rows (up to 512 rows, all m in one tile
    where none does; beyond, 512), 1,024 of the contraction (eight int4 groups of 128), and 1,024 columns for
    tiles of up to 256 rows (512 for larger ones, whose tiles would crowd the kernel's VMEM), or the whole
    dimension where it is smaller.

    Measured on a v5e chip (2026-12-06, benchmarks/serve_weights.py --profile and benchmarks/gmm_formats.py's
    device times, moe-1b's experts read from the stack): tokamax places tiles with a search per call over the
    tiles of rows, a loop that cost 0.62 ms of a 1.94 ms decode step at one slot with 8-row tiles (17 tiles
    of its 136 rows; one tile of 136 rows: none, the step 1.15 ms); each expert's visit fetches its tile's rows
    for every tile of columns, so at 32 slots (192 rows, 64 routed) one tile of all rows took 157, 132 and
    138 us a call (bf16, int8, int4) with 512 columns where 64-row tiles with 1,024 columns took 143, 88 and
    75; at one slot 1,024 columns against 512: 28.4 against 28.7 us (bf16), 23.3 against 24.4 (int8), 26.6
    against 28.2 (int4)."""
    power = next((t for t in (8, 16, 32, 64, 128, 256, 512) if m % t == 0 and m // t <= MAX_ROW_TILES), None)
    # past 512 rows stacked_matmul pads to whole tiles of 512
    rows = power or (512 if m > 512 and m % 512 == 0 else m)
    return rows, min(k, 1024), min(n, 1024 if rows <= 256 else 512)


def int4_kernel_fits(k: int, scales: int, tile_k: int) -> bool:
    """Whether int4_grouped_matmul takes a contraction of k inputs with `scales` scales along it in tiles of
    tile_k: whole lane tiles of inputs a scale, whole scales a tile, and a tile's scales a whole number of
    sublane tiles (8 rows of float32) or all of them."""
    step = k // scales
    return step % 128 == 0 and tile_k % step == 0 and ((tile_k // step) % 8 == 0 or tile_k // step == scales)


# Why stacked_matmul's int4 stacks have a kernel of their own: tokamax's Mosaic wrapper (0.0.12,
# tokamax/_src/mosaic_tpu.py quant_block_spec) takes a QArray's scales along the contraction only repeated 8
# times, one row per 16 inputs, so that each scale fills the v5e's 8 sublanes, and it repeats them with a
# jnp.repeat of the whole operand on every call, whatever shape they come in. For the stack of every MoE
# layer's experts that is every layer's scales in every layer: compiled for a v5e chip, moe-1b's decode step
# wrote bf16[96, 64, 2816] twice and bf16[96, 176, 1024] (34.6 MB each) in each of the layer loop's 6 steps,
# which XLA does not hoist (benchmarks/serve_aot.py). Holding the scales repeated would add a quarter of the
# int4 bytes to HBM (104 MB for moe-1b) and still be repeated again by that wrapper. int4_grouped_matmul runs
# tokamax's schedule instead (its group metadata, grid and tiles: only the routed experts' tiles are visited)
# and reads each tile's scales as the stack holds them, an [8, columns] float32 block per 1,024 inputs (a
# quarter of the bytes of the repeated bfloat16 block), broadcasting one row over the tile's rows in VMEM for
# each group of inputs, where tokamax's kernel multiplies by its repeated rows.


def int4_grouped_matmul(x_MxK: jax.Array, values_GxKxN: jax.Array, scale_GxCxN: jax.Array, sizes_G: jax.Array,
                        tiles: tuple[int, int, int], interpret: bool = False) -> jax.Array:
    """float32 out[m] = x[m] @ (values[g] times its scales) for each row m of group g (sizes_G, in order), each
    of the C scales along the K inputs (one a K / C of them) read as held (float32) and rounded to bfloat16
    where it multiplies, as tokamax's kernel was handed them; rows in no group are left unwritten. Each group
    of inputs' partial product times its scale, summed in float32 in tokamax's order: on the CPU (Pallas'
    interpreter) the exact product to float32's precision (tests/trainer/test_serve_quant.py)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel as mosaic

    m, k = x_MxK.shape
    groups, _, n = values_GxKxN.shape
    step = k // scale_GxCxN.shape[1]
    tm, tk, tn = tiles
    metadata, active = mosaic.make_group_metadata(group_sizes=sizes_G.astype(jnp.int32), m=m, tm=tm, start_group=0,
                                                  num_nonzero_groups=groups, visit_empty_groups=False)

    def rows_map(n_i, grid_id, k_i, metadata):
        return metadata[2][grid_id], k_i

    def group_map(n_i, grid_id, k_i, metadata):
        return metadata[1][grid_id], k_i, n_i

    def out_map(n_i, grid_id, k_i, metadata):
        return metadata[2][grid_id], n_i

    call = pl.pallas_call(
        _int4_tile_kernel(k, step, tiles),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            in_specs=[pl.BlockSpec((tm, tk), rows_map), pl.BlockSpec((None, tk, tn), group_map),
                      pl.BlockSpec((None, tk // step, tn), group_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            grid=(pl.cdiv(n, tn), active, pl.cdiv(k, tk)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="int4_grouped_matmul",
    )
    return call(metadata, x_MxK, values_GxKxN, scale_GxCxN)


def _int4_tile_kernel(k: int, step: int, tiles: tuple[int, int, int]):
    """int4_grouped_matmul's body for one (columns, group's row tile, inputs) tile: the tile's partial products,
    a group of `step` inputs at a time, times their scales into the accumulator; at the last tile of inputs
    the accumulator's rows of this group into the output (its other rows are another group's)."""
    from jax.experimental import pallas as pl

    tm, tk, tn = tiles
    tiles_k = -(-k // tk)
    per_tile, in_last = tk // step, (k - (tiles_k - 1) * tk) // step

    def kernel(metadata, x_ref, q_ref, s_ref, out_ref, acc_ref):
        grid_id, k_i = pl.program_id(1), pl.program_id(2)

        @pl.when(k_i == 0)
        def _zero():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        def accumulate(scales: int):
            for j in range(scales):
                inputs = slice(j * step, (j + 1) * step)
                # the int4 operand as it is, as tokamax's kernel hands it over: Mosaic widens it on the way in
                part = jax.lax.dot_general(x_ref[:, inputs], q_ref[inputs, :], (((1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32)
                acc_ref[...] += part * s_ref[j:j + 1, :].astype(jnp.bfloat16).astype(jnp.float32)

        if in_last == per_tile:
            accumulate(per_tile)
        else:  # the last tile of inputs runs past k: only its scales that hold inputs
            jax.lax.cond(k_i == tiles_k - 1, lambda: accumulate(in_last), lambda: accumulate(per_tile))

        @pl.when(k_i == tiles_k - 1)
        def _store():
            offsets, group_ids, m_tile_ids = metadata
            group = group_ids[grid_id]
            row = jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0) + m_tile_ids[grid_id] * tm
            mine = (row >= offsets[group]) & (row < offsets[group + 1])
            out_ref[...] = jnp.where(mine, acc_ref[...], out_ref[...])

    return kernel


@functools.cache
def tpu_ragged_dot(rows: int, contraction: int, columns: int):
    """tokamax's Mosaic TPU grouped matmul with these tiles. Its tile config is only reachable through the
    module that defines it (tokamax 0.0.12's `_src` path, pinned in pyproject.toml): the public entry point
    picks 128 x 128 x 128, which both refuses a decode step's rows and fetches tiles too small to keep HBM busy."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as mosaic

    return mosaic.PallasMosaicTpuRaggedDot(config=mosaic.Config(tile_m=rows, tile_k=contraction, tile_n=columns))


@functools.cache
def default_impl(platform: str) -> str:
    """ragged_dot where it is a real grouped kernel (TPU, GPU); tiled on CPU."""
    return "tiled" if platform == "cpu" else "ragged_dot"
