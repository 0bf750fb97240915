"""Quantized hub weights, dequantized a tensor at a time while streaming: block-quantized FP8 (DeepSeek-V3's
`quant_method: fp8` with `weight_block_size`), where each FP8 weight `X` comes with `X_scale_inv`, one factor per
block, which multiplies the block back to its values: fp32, or a power of two in float8_e8m0fnu where the config
says `scale_fmt: ue8m0` (DeepSeek-V3.2), both read as their values. And MXFP4 (gpt-oss's `quant_method: mxfp4`):
a weight `X` stored as `X_blocks`, two 4-bit floats a byte, and `X_scales`, one power of two per 32 values.

(FP8's block size, and whether a config names MXFP4, are both read from config.json's quantization_config.)"""

from __future__ import annotations

import numpy as np

from mconvert import dtypes
from mconvert.errors import ConversionError

FP8_DTYPES = (dtypes.float8_e4m3fn, dtypes.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# The sixteen values of a 4-bit float (e2m1), by their bits: sign, then two of exponent and one of mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(config: dict) -> bool:
    """Whether config.json's quantization_config names MXFP4 weights (gpt-oss as released)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype = dtypes.bfloat16) -> np.ndarray:
    """MXFP4 values as a [..., rows, columns] array of `dtype`: `blocks` [..., rows, G, 16] bytes each holding two
    values (the low 4 bits first), `scales` [..., rows, G] the exponents of their groups of 32, biased by 127. In
    gpt-oss's layout rows are the weight's outputs: transformers transposes the result into its [in, out] weights."""
    table = np.array(FP4_VALUES, dtype=np.float32)
    # Each byte's two values at once, low 4 bits first: one lookup a byte instead of one a value.
    pairs = np.stack([np.tile(table, 16), np.repeat(table, 16)], axis=-1)
    *lead, groups, width = blocks.shape
    values = pairs[blocks]  # [..., groups, 16, 2]
    # Exact in fp32 (two bits of mantissa times a power of two), then rounded once to `dtype`, as torch's product
    # of the two in bf16 is.
    values *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None, None]
    return values.astype(dtype).reshape(*lead, groups * width * 2)


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The block size of block-quantized FP8 weights that config.json's quantization_config names
    (DeepSeek-V3: `quant_method: fp8`, `weight_block_size: [128, 128]`), None when it names none (or MXFP4)."""
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if not quantization or is_mxfp4(config):
        return None
    if quantization.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ConversionError(
            f"config.json: quantization_config {quantization} is not supported (block-quantized fp8 with a "
            f"2-D weight_block_size, and mxfp4, are)"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8_blocks(tensor: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """An FP8 weight times its blocks' scales (one per `block` of its last two axes), in fp32."""
    block_rows, block_cols = block
    rows, cols = tensor.shape[-2:]
    factors = scales.astype(np.float32)
    values = tensor.astype(np.float32)
    if rows % block_rows or cols % block_cols:  # partial blocks at the edges: each scale spread over its block
        values *= np.repeat(np.repeat(factors, block_rows, -2)[..., :rows, :], block_cols, -1)[..., :cols]
        return values
    # Whole blocks: the scales broadcast over a blocked view, in place (no tensor-sized factors).
    blocked = values.reshape(*values.shape[:-2], rows // block_rows, block_rows, cols // block_cols, block_cols)
    blocked *= factors[..., :, None, :, None]
    return values
