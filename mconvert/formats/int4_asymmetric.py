"""compressed-tensors' asymmetric pack-quantized INT4 (`symmetric: false`), written for an export in its source's
format: beside `M.weight_packed` and `M.weight_scale`, one zero point per group, `M.weight_zero_point`, packed as
compressed-tensors 0.20 packs it (its `pack_to_int32` with `packed_dim=0`: plus 8, eight a word down the rows,
the first in the low 4 bits, a partial last word's bits zero), [ceil(rows / 8), groups] int32. `dequantize_int4`
reads it back: (q - zero point) x scale."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from mconvert import dtypes
from mconvert.formats.quantized import INT4_MAX, INT4_MIN, INT4_NIBBLES, _nibbles_of, unpack_int4

# An asymmetric group's range [min(w, 0), max(w, 0)] spans the integers' full width, 15 steps.
INT4_STEPS = np.float32(INT4_MAX - INT4_MIN)


def pack_int4(nibbles: np.ndarray) -> np.ndarray:
    """uint8 [rows, columns] integers plus 8 as int32 [rows, ceil(columns / 8)], eight a word, the first in the low 4
    bits (little-endian words), a partial last word's bits zero."""
    rows, columns = nibbles.shape
    padded = np.zeros((rows, -(-columns // 8) * 8), dtype=np.uint8)
    padded[:, :columns] = nibbles
    return (padded[:, 0::2] | padded[:, 1::2] << 4).view("<i4").astype(np.int32)


def quantize_int4_asymmetric(
    values: np.ndarray, group_size: int | None, scale_dtype: np.dtype, source: tuple[np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int32 packed integers [rows, ceil(columns / 8)], scales [rows, groups] of `scale_dtype`, int32 packed zero
    points [ceil(rows / 8), groups]), computed as compressed-tensors 0.20 computes them for a weight of `scale_dtype`
    (`calculate_qparams` with symmetric false, `quantize`, `pack_to_int32`), each step rounded to `scale_dtype` as
    torch's arithmetic in it is: per group of `group_size` columns (None: the row), lo = min(w, 0), hi = max(w, 0),
    scale = (hi - lo) / 15, zero point = -8 - lo / scale clamped to [-8, 7] and rounded to an integer (ties to even),
    a zero scale then the dtype's eps; each integer is w / scale plus the zero point, rounded to the nearest integer
    and clamped to [-8, 7]. With `source` (a release's scales and packed zero points), a group whose values are
    exactly (q - zero point) x its source scale keeps that scale, zero point and those integers."""
    rows, columns = values.shape
    size = group_size or columns
    groups = columns // size
    scales, zeros = np.empty((rows, groups), dtype=scale_dtype), np.empty((rows, groups), dtype=np.uint8)
    nibbles = np.empty((rows, columns), dtype=np.uint8)
    source_zeros = None if source is None else unpack_int4(np.ascontiguousarray(source[1].T), rows).T
    step = max(1, dtypes.LOOKUPS_AT_ONCE // columns)  # rows at a time: each step's temporaries stay in the cache
    for first in range(0, rows, step):
        part = slice(first, first + step)
        given = None if source is None else (source[0][part], source_zeros[part])
        scales[part], zeros[part], nibbles[part] = _asymmetric_rows(values[part], size, scale_dtype, given)
    return pack_int4(nibbles), scales, np.ascontiguousarray(pack_int4(np.ascontiguousarray(zeros.T)).T)


def _asymmetric_rows(
    values: np.ndarray, size: int, scale_dtype: np.dtype, source: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_int4_asymmetric's scales, zero points plus 8 and integers plus 8 (uint8) of a few rows."""
    rows, columns = values.shape
    grouped = values.astype(scale_dtype).astype(np.float32).reshape(rows, columns // size, size)
    lo, hi = np.minimum(grouped.min(-1), 0), np.maximum(grouped.max(-1), 0)

    def rounded(array: np.ndarray) -> np.ndarray:  # torch's result of an operation in scale_dtype
        return array.astype(scale_dtype).astype(np.float32)

    scales = rounded(rounded(hi - lo) / INT4_STEPS)
    with np.errstate(divide="ignore", invalid="ignore"):  # a group of zeros: 0 / 0, as torch's
        zeros = np.clip(rounded(INT4_MIN - rounded(lo / scales)), INT4_MIN, INT4_MAX)
    # torch casts a NaN zero point (a group of zeros) to the integer 0.
    zeros = np.where(np.isnan(zeros), 0, np.rint(zeros)).astype(np.float32)
    scales[scales == 0] = ml_dtypes.finfo(scale_dtype).eps
    sums = rounded(rounded(grouped / scales[..., None]) + zeros[..., None]).astype(scale_dtype)
    table = INT4_NIBBLES.get(sums.dtype.name)
    nibbles = _nibbles_of(sums) if table is None else dtypes.lookup(table, sums.view(np.uint16)).reshape(sums.shape)
    scales = scales.astype(scale_dtype)
    if source is not None:
        source_scales, source_zeros = source
        factors = source_scales.astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a zero scale: no group is exact on it
            kept = np.clip(np.rint(values.reshape(grouped.shape).astype(np.float32) / factors + source_zeros[..., None]), INT4_MIN, INT4_MAX)
            back = ((kept - source_zeros[..., None]) * factors).astype(scale_dtype).astype(values.dtype)
        exact = (back == values.reshape(grouped.shape)).all(-1)
        scales = np.where(exact, source_scales, scales)
        zeros = np.where(exact, source_zeros, zeros)
        nibbles = np.where(exact[..., None], _nibbles_of(kept), nibbles)
    return scales, (zeros - INT4_MIN).astype(np.uint8), nibbles.reshape(rows, columns)
