"""Block FP8 quantized on a release's own scales: a block whose values are exactly float8_e4m3fn values times the
release's scale for it (as `dequantize_fp8_blocks` reads them, compared in the dtype the values come in) keeps that
scale and those values, the release's bytes for a block that training left as the release gave it. The scale that
`quantize_fp8_blocks` computes afresh is the one that takes a block's largest |value| to 448: a release quantized
by another rule (amax / 400, transformers' 1 / (448 / amax), a power of two rounded otherwise, or a block scaled
after quantizing) would otherwise come back as the same values in other bytes."""

from __future__ import annotations

import numpy as np

from mconvert import dtypes, slices
from mconvert.formats.quantized import FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks


def fp8_on_scales(values: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn [..., rows, columns], exact [..., block rows, block columns]) of `values` (an export's, in its
    dtype) on given `scales` (a release's, one per `block`, partial blocks at the edges counted): each value over its
    block's scale, clamped to +-448 and rounded to the nearest float8_e4m3fn; a block exact where each of its values
    is that times the scale as `dequantize_fp8_blocks` gives it back, cast to the values' dtype, bit for bit (-0 is
    not 0: a release's -0 comes back as -0). Computed a slice of block rows at a time on the slices' threads
    (mconvert.slices), on whole blocks (the edges padded with zeros, exact on any scale)."""
    block_rows, block_cols = block
    *lead, rows, cols = values.shape
    grid = scales.shape[-2:]
    matrices, factors = values.reshape(-1, rows, cols), scales.reshape(-1, *grid)
    quantized, exact = np.empty(matrices.shape, dtype=dtypes.float8_e4m3fn), np.empty(factors.shape, dtype=bool)
    bits = np.dtype(f"u{values.dtype.itemsize}")  # compared as bits: ml_dtypes' bf16 comparison is ten times slower

    def stripes(item: tuple[int, slice]) -> None:
        matrix, part = item
        count, first = part.stop - part.start, part.start // block_rows
        stripe = factors[matrix, first : first - (-count // block_rows)]
        padded = np.zeros((len(stripe) * block_rows, grid[1] * block_cols), dtype=np.float32)  # divided in place
        padded[:count, :cols] = matrices[matrix, part]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a zero or non-finite scale: never exact
            padded.reshape(len(stripe), block_rows, grid[1], block_cols)[...] /= stripe.astype(np.float32)[:, None, :, None]
            np.clip(padded, -FP8_MAX, FP8_MAX, out=padded)
            codes = dtypes.to_e4m3(padded)
            back = dequantize_fp8_blocks(codes, stripe, block)
        same = np.ones(back.shape, dtype=bool)
        same[:count, :cols] = np.ascontiguousarray(back[:count, :cols]).astype(values.dtype).view(bits) == np.ascontiguousarray(matrices[matrix, part]).view(bits)
        quantized[matrix, part] = codes[:count, :cols]
        exact[matrix, first : first + len(stripe)] = same.reshape(len(stripe), block_rows, grid[1], block_cols).all(axis=(-3, -1))

    slices.run(stripes, [(matrix, part) for matrix in range(len(matrices)) for part in slices.row_slices(rows, cols, block_rows)])
    return quantized.reshape(values.shape), exact.reshape(*lead, *grid)


def quantize_fp8_on_source(
    values: np.ndarray, block: tuple[int, int], source_scales: np.ndarray | None, power_of_two: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, fp32 scales): `quantize_fp8_blocks` of `values`, but each block exact on its
    `source_scales` (a release's, `fp8_on_scales`) keeps that scale and those values. A weight exact on them
    throughout (left as the release gave it) is not quantized afresh, nor checked whole where none is."""
    if source_scales is None:
        return quantize_fp8_blocks(values, block, power_of_two)
    # Each block's first row first: a weight training changed has no block exact there, and is quantized afresh at
    # the cost of a row in every block's rows, not of a second pass over it.
    if not fp8_on_scales(values[..., :: block[0], :], source_scales, (1, block[1]))[1].any():
        return quantize_fp8_blocks(values, block, power_of_two)
    kept, exact = fp8_on_scales(values, source_scales, block)
    if exact.all():
        return kept, source_scales.astype(np.float32)
    quantized, scales = quantize_fp8_blocks(values, block, power_of_two)
    if not exact.any():
        return quantized, scales
    rows, cols = values.shape[-2:]
    spread = np.repeat(np.repeat(exact, block[0], -2)[..., :rows, :], block[1], -1)[..., :cols]
    return np.where(spread, kept, quantized), np.where(exact, source_scales.astype(np.float32), scales)
