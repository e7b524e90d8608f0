"""FP8 weights with block scales (DeepSeek-V3 on the Hub): `X.weight` in float8 e4m3 and `X.weight_scale_inv`, one
float32 multiplier per block of rows x columns (`quantization_config.weight_block_size`, [128, 128] on the Hub).
A weight is dequantised to bfloat16 one block row at a time (fp8 x its block's multiplier in float32, rounded
once to bfloat16), read from the file by its byte range: safetensors' numpy reader has no float8.
"""

from __future__ import annotations

import os

import numpy as np

from trainer.hf.errors import HFError

FP8 = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"


def block_size(hub: dict, where: str) -> tuple[int, int] | None:
    """quantization_config's block size, None without one; HFError naming the key for any other quantization."""
    quant = hub.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise HFError(f"{where}: 'quantization_config' = {quant!r:.80} is not supported (FP8 e4m3 with block "
                      "scales only)")
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise HFError(f"{where}: 'quantization_config.weight_block_size' must be two positive integers, got "
                      f"{block!r:.80}")
    return block[0], block[1]


def _raw(path: str, name: str) -> np.ndarray:
    """The float8 e4m3 tensor `name` of the safetensors file at `path`, memory-mapped from its byte range."""
    import ml_dtypes

    from trainer.hf.safetensors_io import header

    start, entries = header(path)
    begin, end = entries[name]["data_offsets"]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return data.view(ml_dtypes.float8_e4m3fn).reshape(entries[name]["shape"])


def dequantized(reader, name: str, block: tuple[int, int]) -> np.ndarray:
    """The bfloat16 values of the FP8 weight `name` (a HubReader's), block row by block row."""
    import ml_dtypes

    scale_name = name + SCALE_SUFFIX
    if scale_name not in reader.names():
        raise HFError(f"{reader.where_is(name)}: '{name}' is FP8 but '{scale_name}' (its block scales) is missing")
    w_fp8 = _raw(os.path.join(reader.directory, reader.where[name]), name)
    rows, cols = w_fp8.shape
    blocks = (-(-rows // block[0]), -(-cols // block[1]))
    scale = reader.tensor(scale_name).astype(np.float32)
    if scale.shape != blocks:
        raise HFError(f"{reader.where_is(scale_name)}: '{scale_name}' has shape {list(scale.shape)}; blocks of "
                      f"{list(block)} over {name}'s {[rows, cols]} make it {list(blocks)}")
    out = np.empty((rows, cols), ml_dtypes.bfloat16)
    for i in range(blocks[0]):
        part = slice(i * block[0], (i + 1) * block[0])
        multiplier = np.repeat(scale[i], block[1])[:cols]
        out[part] = (w_fp8[part].astype(np.float32) * multiplier).astype(ml_dtypes.bfloat16)
    return out
