"""Block FP8 quantized on a release's own scales: a block whose values are exactly float8_e4m3fn values times the
release's scale for it (as `dequantize_fp8_blocks` reads them, compared in the dtype the values come in) keeps that
scale and those values, the release's bytes for a block that training left as the release gave it. The scale that
`quantize_fp8_blocks` computes afresh is the one that takes a block's largest |value| to 448: a release quantized
by another rule (amax / 400, transformers' 1 / (448 / amax), a power of two rounded otherwise, or a block scaled
after quantizing) would otherwise come back as the same values in other bytes."""

from __future__ import annotations

import numpy as np

from mconvert import dtypes
from mconvert.formats.quantized import FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks


def fp8_on_scales(values: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn [..., rows, columns], exact [..., block rows, block columns]) of `values` (an export's, in its
    dtype) on given `scales` (a release's, one per `block`, partial blocks at the edges counted): each value over its
    block's scale, clamped to +-448 and rounded to the nearest float8_e4m3fn; a block exact where each of its values
    is that times the scale as `dequantize_fp8_blocks` gives it back, cast to the values' dtype."""
    block_rows, block_cols = block
    *lead, rows, cols = values.shape
    factors = scales.astype(np.float32)
    spread = np.repeat(np.repeat(factors, block_rows, -2)[..., :rows, :], block_cols, -1)[..., :cols]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a zero or non-finite scale: never exact
        quotients = values.astype(np.float32) / spread
        np.clip(quotients, -FP8_MAX, FP8_MAX, out=quotients)
        quantized = dtypes.to_e4m3(np.ascontiguousarray(quotients))
        same = dequantize_fp8_blocks(quantized, scales, block).astype(values.dtype) == values
    grid = factors.shape[-2:]
    padded = np.ones((*lead, grid[0] * block_rows, grid[1] * block_cols), dtype=bool)
    padded[..., :rows, :cols] = same
    return quantized, padded.reshape(*lead, grid[0], block_rows, grid[1], block_cols).all(axis=(-3, -1))


def quantize_fp8_on_source(
    values: np.ndarray, block: tuple[int, int], source_scales: np.ndarray | None, power_of_two: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, fp32 scales): `quantize_fp8_blocks` of `values`, but each block exact on its
    `source_scales` (a release's, `fp8_on_scales`) keeps that scale and those values."""
    quantized, scales = quantize_fp8_blocks(values, block, power_of_two)
    if source_scales is None:
        return quantized, scales
    kept, exact = fp8_on_scales(values, source_scales, block)
    rows, cols = values.shape[-2:]
    spread = np.repeat(np.repeat(exact, block[0], -2)[..., :rows, :], block[1], -1)[..., :cols]
    return np.where(spread, kept, quantized), np.where(exact, source_scales.astype(np.float32), scales)
