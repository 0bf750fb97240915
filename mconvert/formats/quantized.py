"""Quantized hub weights, dequantized a tensor at a time while streaming: block-quantized FP8 (DeepSeek-V3's
`quant_method: fp8` with `weight_block_size`), where each FP8 weight `X` comes with `X_scale_inv`, one factor per
block, which multiplies the block back to its values: fp32, or a power of two in float8_e8m0fnu where the config
says `scale_fmt: ue8m0` (DeepSeek-V3.2), both read as their values."""

from __future__ import annotations

import torch

from mconvert.errors import ConversionError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The block size of block-quantized FP8 weights that config.json's quantization_config names
    (DeepSeek-V3: `quant_method: fp8`, `weight_block_size: [128, 128]`), None when it names none."""
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if not quantization:
        return None
    if quantization.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ConversionError(
            f"config.json: quantization_config {quantization} is not supported (block-quantized fp8 with a "
            f"2-D weight_block_size is)"
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
