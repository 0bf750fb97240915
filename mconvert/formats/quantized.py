"""Quantized hub weights, dequantized a tensor at a time while streaming: block-quantized FP8 (DeepSeek-V3's
`quant_method: fp8` with `weight_block_size`), where each FP8 weight `X` comes with `X_scale_inv`, one factor per
block, which multiplies the block back to its values: fp32, or a power of two in float8_e8m0fnu where the config
says `scale_fmt: ue8m0` (DeepSeek-V3.2), both read as their values. MXFP4 (gpt-oss's `quant_method: mxfp4`):
a weight `X` stored as `X_blocks`, two 4-bit floats a byte, and `X_scales`, one power of two per 32 values. And
compressed-tensors' pack-quantized INT4 (Kimi-K2-Thinking's and Kimi-K2.5's experts): a linear layer `M` stored as
`M.weight_packed`, eight 4-bit integers an int32, `M.weight_scale`, one factor per group of a row, `M.weight_shape`
and, where asymmetric, `M.weight_zero_point`. FP8 blocks, symmetric INT4 and MXFP4 are also written (`quantize_fp8_blocks`,
`quantize_int4`, `quantize_mxfp4`; asymmetric INT4 in int4_asymmetric), for an export in the format of its source.

(FP8's block size, whether a config names MXFP4, and the INT4 scheme are all read from config.json's
quantization_config, or its text_config's where the config describes an image-text model.)"""

from __future__ import annotations

import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mconvert import dtypes, slices
from mconvert.errors import ConversionError

FP8_DTYPES = (dtypes.float8_e4m3fn, dtypes.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# The sixteen values of a 4-bit float (e2m1), by their bits: sign, then two of exponent and one of mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The bf16 values of each byte of MXFP4 (the low 4 bits first) under each exponent, a uint32 of two bf16 a pair, at
# exponent x 256 + byte: each value exact in fp32 (two bits of mantissa times a power of two), rounded once to bf16,
# as torch's product of the two in bf16 is. 256 KiB, which stays in the cache.
with np.errstate(over="ignore", invalid="ignore"):  # the exponent 255 (NaN in the spec) gives Inf and NaN, as torch's
    MXFP4_PAIRS = (
        np.stack([np.tile(FP4_VALUES, 16), np.repeat(FP4_VALUES, 16)], axis=-1).astype(np.float32)
        * np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)[:, None, None]
    ).astype(dtypes.bfloat16).view(np.uint32).reshape(-1)


def quantization_config(config: dict) -> dict:
    """config.json's quantization_config, or its text_config's where it has none (Kimi-K2.5 states its language
    model's there); {} where neither names one."""
    text = config.get("text_config")
    return config.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None) or {}


def is_mxfp4(config: dict) -> bool:
    """Whether config.json's quantization_config names MXFP4 weights (gpt-oss as released)."""
    return quantization_config(config).get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 values as a [..., rows, columns] bf16 array: `blocks` [..., rows, G, 16] bytes each holding two values
    (the low 4 bits first), `scales` [..., rows, G] the exponents of their groups of 32, biased by 127. In gpt-oss's
    layout rows are the weight's outputs: transformers transposes the result into its [in, out] weights. Each byte's
    two bf16 values under its group's exponent are one lookup (`MXFP4_PAIRS`), a slice of rows at a time."""
    *lead, groups, width = blocks.shape
    blocks, scales = blocks.reshape(-1, groups, width), scales.reshape(-1, groups)
    pairs = np.empty(blocks.shape, dtype=np.uint32)
    def rows(part: slice) -> None:
        index = np.empty(blocks[part].shape, dtype=np.intp)
        np.left_shift(scales[part, :, None], 8, out=index, dtype=np.intp)
        np.bitwise_or(index, blocks[part], out=index)
        np.take(MXFP4_PAIRS, index, out=pairs[part])
    slices.run(rows, slices.row_slices(len(blocks), groups * width))
    return pairs.view(dtypes.bfloat16).reshape(*lead, groups * width * 2)


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The block size of block-quantized FP8 weights that config.json's quantization_config names
    (DeepSeek-V3: `quant_method: fp8`, `weight_block_size: [128, 128]`), None when it names none (or MXFP4)."""
    quantization = quantization_config(config)
    block = quantization.get("weight_block_size")
    if not quantization or quantization.get("quant_method") in ("mxfp4", COMPRESSED_TENSORS):
        return None
    if quantization.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ConversionError(
            f"config.json: quantization_config {quantization} is not supported (block-quantized fp8 with a "
            f"2-D weight_block_size, mxfp4, and compressed-tensors' pack-quantized INT4 are)"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8_blocks(tensor: np.ndarray, scales: np.ndarray, block: tuple[int, int], dtype: np.dtype = dtypes.float32) -> np.ndarray:
    """An FP8 weight times its blocks' scales (one per `block` of its last two axes), computed in fp32 and given in
    `dtype` (fp32, or rounded once to bf16 as a cast of the fp32 product is): a slice of block rows at a time on
    the slices' threads (mconvert.slices), each rounded into its rows of the result, so that no fp32 tensor is held.
    A float8_e4m3fn one of whole blocks without NaN and with scales below 2^8 (every release's) is rebuilt from its
    bits (five times faster than the cast); anything else (a slice holding a NaN too) is cast."""
    block_rows, block_cols = block
    *lead, rows, cols = tensor.shape
    matrices = tensor.reshape(-1, rows, cols)
    factors = scales.astype(np.float32).reshape(len(matrices), *scales.shape[-2:])
    bits = tensor.dtype == dtypes.float8_e4m3fn and not (rows % block_rows or cols % block_cols) and np.abs(factors).max(initial=0) < 2**8
    out = np.empty(matrices.shape, dtype=dtype)
    def stripes(item: tuple[int, slice]) -> None:
        matrix, part = item
        weights, grid = matrices[matrix, part], factors[matrix, part.start // block_rows : -(-part.stop // block_rows)]
        values = dtypes.e4m3_blocks(weights.reshape(-1, block_rows, cols), grid * dtypes.E4M3_UNBIAS) if bits else None
        if values is None:
            values = weights.astype(np.float32)  # each scale spread over its block (partial ones at the edges cut)
            values *= np.repeat(np.repeat(grid, block_rows, 0)[: len(values)], block_cols, 1)[:, :cols]
        out[matrix, part] = values.reshape(-1, cols)
    slices.run(stripes, [(matrix, part) for matrix in range(len(matrices)) for part in slices.row_slices(rows, cols, block_rows)])
    return out.reshape(tensor.shape)


# The largest float8_e4m3fn value: a block's largest magnitude is quantized to it.
FP8_MAX = np.float32(448.0)


def quantize_fp8_blocks(values: np.ndarray, block: tuple[int, int], power_of_two: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, fp32 scale per `block` of its last two axes): the inverse of `dequantize_fp8_blocks`,
    computed as compressed-tensors' block FP8 (and DeepSeek-V3's own `act_quant`) computes it. Per block, in fp32:
    scale = amax(|w|) / 448, each value w / scale clamped to +-448 and rounded to the nearest float8_e4m3fn (ties to
    even); the scale is stored as `_scale_inv`, the factor that dequantizes (w = q * scale). A block of zeros gets
    fp32's eps as its scale, as compressed-tensors gives it (no division by zero), and zero bytes. Partial blocks
    at the edges take the amax of their own values. `power_of_two` (`scale_fmt: ue8m0`): amax / 448 rounded up to a
    power of two (DeepGEMM's `ceil_to_ue8m0`), a block of zeros 1, as transformers' Fp8Quantize gives them."""
    block_rows, block_cols = block
    *lead, rows, cols = values.shape
    matrices = values.reshape(-1, rows, cols)
    grid = (-(-rows // block_rows), -(-cols // block_cols))
    codes, scales = np.empty(matrices.shape, dtype=dtypes.float8_e4m3fn), np.empty((len(matrices), *grid), dtype=np.float32)
    def stripes(item: tuple[int, slice]) -> None:
        matrix, part = item
        count, stripe_rows = part.stop - part.start, -(-(part.stop - part.start) // block_rows)
        padded = np.zeros((stripe_rows * block_rows, grid[1] * block_cols), dtype=np.float32)  # divided in place
        padded[:count, :cols] = matrices[matrix, part]
        blocked = padded.reshape(stripe_rows, block_rows, grid[1], block_cols)
        amax = np.maximum(blocked.max(axis=(-3, -1)), -blocked.min(axis=(-3, -1)))
        factors = np.where(amax > 0, amax / FP8_MAX, np.float32(1) if power_of_two else np.finfo(np.float32).eps)
        if power_of_two:  # the exponent bits of amax / 448, one more where any mantissa bit is set
            factors = ((factors.view(np.int32) + F32_MANTISSA) & F32_EXPONENT).view(np.float32)
        blocked /= factors[:, None, :, None]
        np.clip(blocked, -FP8_MAX, FP8_MAX, out=blocked)
        codes[matrix, part] = dtypes.to_e4m3(np.ascontiguousarray(padded[:count, :cols]))
        scales[matrix, part.start // block_rows : part.start // block_rows + stripe_rows] = factors
    slices.run(stripes, [(matrix, part) for matrix in range(len(matrices)) for part in slices.row_slices(rows, cols, block_rows)])
    return codes.reshape(values.shape), scales.reshape(*lead, *grid)


COMPRESSED_TENSORS = "compressed-tensors"
# A pack-quantized linear layer's tensors, beside its name (compressed-tensors' PackedQuantizationCompressor).
PACKED, SCALE, SHAPE, ZERO_POINT = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point"
# The two integers of each byte of packed INT4, the low 4 bits first, stored as compressed-tensors stores them: plus 8.
INT4_PAIRS = np.stack([np.tile(np.arange(16) - 8, 16), np.repeat(np.arange(16) - 8, 16)], axis=-1).astype(np.float32)


def _names(pattern: str, module: str) -> bool:
    """Whether a quantization_config `ignore` or `targets` entry names `module`, as compressed-tensors matches names:
    `re:` and a regular expression matched from the start of the name, else the whole name."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), module) is not None
    return pattern == module


@dataclass(frozen=True)
class PackQuantized:
    """compressed-tensors' pack-quantized INT4 weights as config.json's quantization_config states them: the modules
    its `ignore` list leaves unquantized and those its `targets` name, the group size (None: one scale a row,
    `strategy: channel`), and whether the integers are symmetric (no zero points)."""

    ignore: tuple[str, ...]
    targets: tuple[str, ...]
    group_size: int | None
    symmetric: bool

    def ignored_by(self, module: str) -> str | None:
        """The `ignore` entry that leaves `module` unquantized, None where none does."""
        return next((pattern for pattern in self.ignore if _names(pattern, module)), None)

    def targets_module(self, module: str) -> bool:
        """Whether `targets` takes in `module`, as compressed-tensors' dequantization of a checkpoint (no model in
        hand) decides: every module where they name the class `Linear` (or nothing), else those they name."""
        return not self.targets or "Linear" in self.targets or any(_names(pattern, module) for pattern in self.targets)


def pack_quantized(config: dict) -> PackQuantized | None:
    """The INT4 weights config.json's quantization_config names (compressed-tensors' `pack-quantized` format), None
    where it names none; an error naming what it names that is not 4-bit integer weights alone, in groups of a row
    or one scale a row."""
    quantization = quantization_config(config)
    if quantization.get("quant_method") != COMPRESSED_TENSORS:
        return None
    supported = "(compressed-tensors' pack-quantized 4-bit integer weights, in groups of a row or one scale a row, are)"
    schemes, targets = set(), []
    for key, group in (quantization.get("config_groups") or {}).items():
        weights, fmt = group.get("weights") or {}, group.get("format") or quantization.get("format")
        what = f"config_groups.{key}"
        if fmt != "pack-quantized":
            what += f" format {fmt}"
        elif group.get("input_activations") or group.get("output_activations"):
            what += " quantizing activations"
        elif (weights.get("type"), weights.get("num_bits"), weights.get("dynamic") or False) != ("int", 4, False):
            what += f" weights of type {weights.get('type')}, num_bits {weights.get('num_bits')}, dynamic {weights.get('dynamic')}"
        elif weights.get("strategy") not in ("group", "channel") or weights.get("actorder") == "group":
            # actorder group stores its groups by a permutation of the columns (weight_g_idx).
            what += f" weights of strategy {weights.get('strategy')}, actorder {weights.get('actorder')}"
        else:
            group_size = weights.get("group_size") if weights["strategy"] == "group" else None
            if weights["strategy"] == "group" and not (isinstance(group_size, int) and group_size > 0):
                what += f" group_size {group_size}"
            else:
                schemes.add((group_size, bool(weights.get("symmetric", True))))
                targets += group.get("targets") or []
                continue
        raise ConversionError(f"config.json: quantization_config's {what} is not supported {supported}")
    if quantization.get("kv_cache_scheme") or len(schemes) != 1:
        why = "a kv_cache_scheme" if quantization.get("kv_cache_scheme") else f"{len(schemes) or 'no'} weight schemes"
        raise ConversionError(f"config.json: quantization_config with {why} is not supported {supported}")
    ((group_size, symmetric),) = schemes
    return PackQuantized(tuple(quantization.get("ignore") or ()), tuple(targets), group_size, symmetric)


def unpack_int4(words: np.ndarray, count: int) -> np.ndarray:
    """The 4-bit integers packed in int32 `words` [..., n], as stored (little-endian), as fp32 [..., count]: value
    i of a row is bits 4 (i % 8) up of word i // 8, less 8; in the stored bytes, byte i // 2's low 4 bits for an
    even i, its high 4 for an odd one. Each byte's two values are looked up at once."""
    pairs = np.take(INT4_PAIRS, np.ascontiguousarray(words).view(np.uint8), axis=0)
    values = pairs.reshape(*words.shape[:-1], -1)
    return values if values.shape[-1] == count else values[..., :count]


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, columns: int, zero_points: np.ndarray | None = None) -> np.ndarray:
    """A pack-quantized weight as [rows, columns] of its scales' dtype, as compressed-tensors' decompression gives it:
    each integer (less its group's zero point) times its group's scale, computed in the scales' dtype. `packed` [rows,
    ceil(columns / 8)] int32, `scales` [rows, groups] (columns / groups values each: one group a row for strategy
    channel), `zero_points` [ceil(rows / 8), groups] int32, packed along the rows. In fp32 here: a 4-bit integer, or
    the difference of two, times a bf16 or fp16 scale is exact there, and is then rounded once to the scales' dtype,
    as torch's bf16 and fp16 products are (computed in fp32, rounded to nearest even); an fp32 scale's product is
    rounded in fp32, as torch's is. A slice of rows at a time (mconvert.slices), each rounded into its rows."""
    rows, groups = scales.shape
    zeros = None if zero_points is None else unpack_int4(zero_points.T, rows).T
    out = np.empty((rows, columns), dtype=scales.dtype)
    def part_of(part: slice) -> None:
        grouped = unpack_int4(packed[part], columns).reshape(-1, groups, columns // groups)
        if zeros is not None:
            grouped -= zeros[part, :, None]
        grouped *= scales[part].astype(np.float32)[..., None]
        out[part] = grouped.reshape(-1, columns)
    slices.run(part_of, slices.row_slices(rows, columns))
    return out


# A signed 4-bit integer's range. compressed-tensors' symmetric scale is a group's largest magnitude over half the
# range's width (15 / 2): that magnitude lands on 7.5, which rounds to 8, kept as -8 for a negative value, clamped to 7.
INT4_MIN, INT4_MAX = -8, 7
INT4_HALF_WIDTH = np.float32((INT4_MAX - INT4_MIN) / 2)


def int4_on_scales(values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp32 integers [rows, groups, size], exact [rows, groups]) of `values` [rows, groups, size] (an export's, in
    its dtype) on given `scales` [rows, groups] (a release's): each integer its value over its group's scale,
    rounded and clamped to [-8, 7]; a group exact where each of its values is its integer times the scale as
    `dequantize_int4` reads them back (the product in fp32, rounded once to the scales' dtype), cast to the values'
    dtype, so that the comparison is exact in the dtype the values come in. A release's bf16 scales give bf16 values,
    which fp32 and bf16 hold exactly: each group of a weight left as it was is exact. fp32 (or fp16) scales give q x s
    in fp32, which a bf16 checkpoint rounds: exported in bf16, such a group is still exact (the comparison is in
    bf16); exported in fp32, it is exact only where each q x s of it is a bf16 value, and any other is not."""
    factors = scales.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale: no group of values is exact on it
        integers = np.clip(np.rint(values.astype(np.float32) / factors), INT4_MIN, INT4_MAX)
        given = (integers * factors).astype(scales.dtype).astype(values.dtype)
    return integers, (given == values).all(-1)


def quantize_int4(
    values: np.ndarray, group_size: int | None, scale_dtype: np.dtype, source_scales: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [rows, ceil(columns / 8)] packed integers, [rows, groups] scales of `scale_dtype`): the symmetric
    inverse of `dequantize_int4`, computed as compressed-tensors 0.20 computes it for a weight of `scale_dtype` (its
    `calculate_qparams`, `quantize` and `pack_to_int32`). The values are cast to `scale_dtype` first, where a release's
    weights were before it was quantized. Per group of `group_size` columns of a row (None: the whole row): scale =
    amax(|w|) / 7.5, zero where amax is (then the dtype's eps, as compressed-tensors gives it); each integer is w /
    scale, rounded to `scale_dtype` (torch's bf16 quotient is), then to the nearest integer (ties to even) and
    clamped to [-8, 7]; packed plus 8, eight a word, the first in the low 4 bits (little-endian words).
    With `source_scales` (a release's, of `scale_dtype`), a group whose values are exactly integers in [-8, 7] times
    its source scale (`int4_on_scales`) keeps that scale and those integers, the release's bytes for a weight left
    as the release gave it: its values quantized afresh would get amax / 7.5, about 16 / 15 or 14 / 15 of it."""
    rows, columns = values.shape
    size = group_size or columns
    scales = np.empty((rows, columns // size), dtype=scale_dtype)
    packed = np.empty((rows, -(-columns // 8)), dtype=np.int32)
    def part_of(part: slice) -> None:  # a slice of rows (mconvert.slices), packed into its rows
        nibbles = np.zeros((part.stop - part.start, packed.shape[1] * 8), dtype=np.uint8)  # a partial last word: zero bits, as theirs
        scales[part], nibbles[:, :columns] = _int4_rows(values[part], size, scale_dtype, None if source_scales is None else source_scales[part])
        packed[part] = (nibbles[:, 0::2] | nibbles[:, 1::2] << 4).view("<i4")
    slices.run(part_of, slices.row_slices(rows, columns))
    return packed, scales


def _int4_rows(values: np.ndarray, size: int, scale_dtype: np.dtype, source_scales: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """quantize_int4's scales and integers plus 8 (uint8) of a few rows."""
    rows, columns = values.shape
    grouped = values.astype(scale_dtype).astype(np.float32).reshape(rows, columns // size, size)
    # torch computes a bf16 or fp16 quotient in fp32 and rounds it once, as the casts here do.
    scales = (np.maximum(grouped.max(-1), -grouped.min(-1)) / INT4_HALF_WIDTH).astype(scale_dtype)
    scales[scales == 0] = ml_dtypes.finfo(scale_dtype).eps
    grouped /= scales.astype(np.float32)[..., None]
    quotients = grouped.astype(scale_dtype)
    # bf16 or fp16: rounded, clamped and offset by one lookup of their bits.
    table = INT4_NIBBLES.get(quotients.dtype.name)
    nibbles = _nibbles_of(quotients) if table is None else dtypes.lookup(table, quotients.view(np.uint16))
    if source_scales is not None:
        kept, exact = int4_on_scales(values.reshape(rows, -1, size), source_scales)
        scales = np.where(exact, source_scales, scales)
        with np.errstate(invalid="ignore"):  # NaN where a source scale is zero: such a group is not exact
            nibbles = np.where(exact[..., None], (kept - INT4_MIN).astype(np.uint8), nibbles)
    return scales, nibbles.reshape(rows, columns)


def _nibbles_of(values: np.ndarray) -> np.ndarray:
    """Each value rounded to the nearest integer (ties to even), clamped to [-8, 7], plus 8, as uint8."""
    with np.errstate(invalid="ignore"):  # NaN: what numpy's cast gives, as before the lookup
        return (np.clip(np.rint(values.astype(np.float32)), INT4_MIN, INT4_MAX) - INT4_MIN).astype(np.uint8)


# `_nibbles_of` each bf16 and fp16 value, by its bits (64 KiB each).
INT4_NIBBLES = {dtype.name: _nibbles_of(np.arange(1 << 16, dtype=np.uint16).view(dtype)) for dtype in (dtypes.bfloat16, dtypes.float16)}


# An MXFP4 group's values share one scale; the largest 4-bit float (e2m1).
MXFP4_GROUP, FP4_MAX = 32, np.float32(6.0)
# float32's exponent bits, and the mantissa bits below them: a power of two is its exponent bits alone.
F32_EXPONENT, F32_MANTISSA = 0x7F800000, 0x007FFFFF
# Each bf16 value's nearest e2m1 code (ties to even, clamped to +-6, the sign kept), by the value's 16 bits: a bf16
# value times a power of two is a bf16 value, so quantizing one is a lookup (a quarter of the time of a cast).
with np.errstate(invalid="ignore"):  # the NaN patterns, which finite weights never hold
    E2M1_OF_BF16 = np.clip(np.arange(1 << 16, dtype=np.uint16).view(dtypes.bfloat16).astype(np.float32), -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


# By the stored exponent s: the scale's reciprocal 2^(127 - s), and half the scale 2^(s - 128), both fp32 values for
# every s (2^-128 a subnormal), so that a product with either is the exact product rounded once, as numpy's ldexp
# gives it; twice an e2m1 value is exact, and times half the scale is its value times the scale.
SCALE_RECIPROCALS = np.ldexp(np.float32(1), 127 - np.arange(256, dtype=np.int32))
HALF_SCALES = np.ldexp(np.float32(1), np.arange(256, dtype=np.int32) - 128)
FP4_DOUBLED = 2 * np.array(FP4_VALUES, dtype=np.float32)


def mxfp4_on_scales(values: np.ndarray, exponents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes [..., rows, groups, 32], exact [..., rows, groups]) of `values` [..., rows, columns] (an export's,
    in its dtype) on given `exponents` [..., rows, groups] (a release's, biased by 127): each code its value times the
    scale's reciprocal (exact: a power of two), rounded to the nearest e2m1 as `quantize_mxfp4` rounds it; a group
    exact where each of its values is its code's value times the scale, cast to the values' dtype (exact in fp32 and
    bf16 alike), so that the comparison is exact in the dtype the values come in."""
    *lead, rows, columns = values.shape
    grouped = values.reshape(*lead, rows, columns // MXFP4_GROUP, MXFP4_GROUP)
    with np.errstate(over="ignore", invalid="ignore"):  # values past bf16's range: no e2m1 code gives them
        scaled = grouped.astype(np.float32)
        scaled *= np.take(SCALE_RECIPROCALS, exponents)[..., None]
        codes = dtypes.lookup(E2M1_OF_BF16, scaled.astype(dtypes.bfloat16).view(np.uint16))
        given = dtypes.lookup(FP4_DOUBLED, codes)
        given *= np.take(HALF_SCALES, exponents)[..., None]
    return codes, (given.astype(values.dtype) == grouped).all(-1)


def quantize_mxfp4(values: np.ndarray, source_exponents: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 blocks [..., rows, columns / 32, 16], uint8 scales [..., rows, columns / 32]): the inverse of
    `dequantize_mxfp4` for `values` [..., rows, columns], computed as triton_kernels' `downcast_to_mxfp` computes it
    (the quantizer that gpt-oss's reference and transformers' `quantize_to_mxfp4` call) with its default rounding of
    the scales, up (ROUND_UP). The values are cast to bf16 first, as those callers do. Per group of 32 values of a
    row, in fp32: the scale is amax / 6 rounded up to a power of two, so that no value passes 6 (the OCP spec's
    floor(log2(amax)) - 2 gives the same scale where a group's largest value quantizes to 4 or 6, and a smaller one
    where it would quantize to 3, which the rounding up gives); its exponent bits are the stored byte (biased by
    127), and a group of zeros gets 0. Each value times the scale's reciprocal is rounded to the nearest e2m1 (ties
    to even), clamped to +-6, its sign kept (a small negative value is -0); two a byte, the first in the low 4 bits.
    With `source_exponents` (a release's), a group whose values are exactly e2m1 values times its source scale
    (`mxfp4_on_scales`) keeps that scale and those codes, the release's bytes for a weight left as the release gave
    it: where its largest value is 3 times its scale or less, its values quantized afresh would get a smaller scale."""
    *lead, rows, columns = values.shape
    flat, groups = values.reshape(-1, columns), columns // MXFP4_GROUP
    blocks, stored = np.empty((len(flat), groups, MXFP4_GROUP // 2), dtype=np.uint8), np.empty((len(flat), groups), dtype=np.uint8)
    source = None if source_exponents is None else source_exponents.reshape(-1, groups)
    def part_of(part: slice) -> None:  # a slice of rows (mconvert.slices)
        blocks[part], stored[part] = _mxfp4_rows(flat[part], None if source is None else source[part])
    slices.run(part_of, slices.row_slices(len(flat), columns))
    return blocks.reshape(*lead, rows, groups, MXFP4_GROUP // 2), stored.reshape(*lead, rows, groups)


def _mxfp4_rows(values: np.ndarray, source_exponents: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """quantize_mxfp4 of a few rows."""
    rows, columns = values.shape
    grouped = values.astype(dtypes.bfloat16).reshape(rows, columns // MXFP4_GROUP, MXFP4_GROUP)
    # A finite bf16 value's magnitude orders as its bits less the sign; as fp32, the bits shifted up 16.
    amax = ((grouped.view(np.uint16) & 0x7FFF).max(-1).astype(np.uint32) << 16).view(np.float32)
    exponents = ((amax / FP4_MAX).view(np.int32) + F32_MANTISSA) & F32_EXPONENT
    powers = exponents.view(np.float32)
    scaled = grouped.astype(np.float32)
    scaled *= np.divide(1, powers, out=np.zeros_like(powers), where=powers > 0)[..., None]
    codes = dtypes.lookup(E2M1_OF_BF16, scaled.astype(dtypes.bfloat16).view(np.uint16))
    stored = (exponents >> 23).astype(np.uint8)
    if source_exponents is not None:
        kept, exact = mxfp4_on_scales(values, source_exponents)
        codes = np.where(exact[..., None], kept, codes)
        stored = np.where(exact, source_exponents, stored)
    pairs = codes.reshape(rows, columns // MXFP4_GROUP, MXFP4_GROUP // 2, 2)
    return pairs[..., 0] | pairs[..., 1] << 4, stored
