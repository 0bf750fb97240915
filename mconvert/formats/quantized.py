"""Quantized hub weights, dequantized a tensor at a time while streaming: block-quantized FP8 (DeepSeek-V3's
`quant_method: fp8` with `weight_block_size`), where each FP8 weight `X` comes with `X_scale_inv`, one factor per
block, which multiplies the block back to its values: fp32, or a power of two in float8_e8m0fnu where the config
says `scale_fmt: ue8m0` (DeepSeek-V3.2), both read as their values. And MXFP4 (gpt-oss's `quant_method: mxfp4`):
a weight `X` stored as `X_blocks`, two 4-bit floats a byte, and `X_scales`, one power of two per 32 values.

(FP8's block size, and whether a config names MXFP4, are both read from config.json's quantization_config.)"""

from __future__ import annotations

import torch

from mconvert.errors import ConversionError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# The sixteen values of a 4-bit float (e2m1), by their bits: sign, then two of exponent and one of mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(config: dict) -> bool:
    """Whether config.json's quantization_config names MXFP4 weights (gpt-oss as released)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 values as a [..., rows, columns] tensor of `dtype`: `blocks` [..., rows, G, 16] bytes each holding two
    values (the low 4 bits first), `scales` [..., rows, G] the exponents of their groups of 32, biased by 127. In
    gpt-oss's layout rows are the weight's outputs: transformers transposes the result into its [in, out] weights."""
    table = torch.tensor(FP4_VALUES, dtype=dtype)
    # Each byte's two values at once, low 4 bits first: one lookup a byte instead of one a value.
    pairs = torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1)
    *lead, groups, width = blocks.shape
    values = pairs[blocks.to(torch.int32)]  # [..., groups, 16, 2]
    # Exact: two bits of mantissa times a power of two within bf16's exponents is a bf16 value.
    values.mul_(torch.exp2(scales.to(torch.float32) - 127.0).to(dtype)[..., None, None])
    return values.reshape(*lead, groups * width * 2)


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


def dequantize_fp8_blocks(tensor: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An FP8 weight times its blocks' scales (one per `block` of its last two axes), in fp32."""
    block_rows, block_cols = block
    rows, cols = tensor.shape[-2:]
    if rows % block_rows or cols % block_cols:  # partial blocks at the edges: each scale spread over its block
        factors = scales.float().repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)[..., :cols]
        return tensor.float() * factors
    # Whole blocks: the scales broadcast over a blocked view, in place (no tensor-sized factors).
    values = tensor.float()
    blocked = values.view(*values.shape[:-2], rows // block_rows, block_rows, cols // block_cols, block_cols)
    blocked.mul_(scales.float()[..., :, None, :, None])
    return values
