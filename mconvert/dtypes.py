"""The dtypes a conversion moves, as numpy's dtypes (ml_dtypes adds bfloat16 and the float8s), named as torch names
them: the conversion's tensors are numpy arrays, so that converting never imports torch (whose import alone took
1.0-1.5 s on the 2-core box and 3-5 s on the GPU machines' hosts, most of a small model's conversion). Code that
holds torch tensors (verify, the state-dict API, weight sync) takes `torch_dtype`.

Casts are numpy's and ml_dtypes' (round to nearest even, as torch's), and `finite` scans a float tensor's bits."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
float16, float32, float64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
uint8 = np.dtype(np.uint8)

# By torch's name of each: what safetensors files, DCP's metadata and torch.save's records name.
BY_NAME = {
    dtype.name: dtype
    for dtype in (float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, uint8)
    + tuple(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.int8, np.bool_))
}
# What the files a conversion reads may name besides (a stored tensor of the optimizer's, a dtype in stored args),
# read as numpy's dtype of the same bits; any other dtype torch names (its sub-byte and quantized ones) is refused.
STORED = BY_NAME | {
    dtype.name: dtype
    for dtype in (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64), np.dtype(np.complex64), np.dtype(np.complex128),
                  np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(ml_dtypes.float8_e5m2fnuz))
}
# Each floating-point dtype's exponent bits, all set in Inf and NaN, within its bits viewed as an unsigned integer
# with the sign cleared: how `finite` tells them. float8 weights are checked once dequantized, in fp32.
_EXPONENT = {
    "float64": (np.uint64, 0x7FF0_0000_0000_0000), "float32": (np.uint32, 0x7F80_0000), "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
}
# Elements scanned at a time: the masked copy stays in the cache.
_SCAN = 1 << 16


def dtype_of(value: Any) -> np.dtype:
    """The dtype of a numpy dtype, a torch dtype or a name ("bfloat16", "torch.bfloat16")."""
    name = value.name if isinstance(value, np.dtype) else str(value).removeprefix("torch.")
    if name not in BY_NAME:
        raise ValueError(f"dtype {value} is not one a conversion moves")
    return BY_NAME[name]


def is_floating(dtype: np.dtype) -> bool:
    return dtype.name.startswith(("float", "bfloat"))


def torch_dtype(dtype: np.dtype):
    """torch's dtype of the same name (imports torch)."""
    import torch

    return getattr(torch, dtype_of(dtype).name)


def cast(tensor: Any, dtype: np.dtype) -> Any:
    """A numpy array or a torch tensor in `dtype` (itself when it has it already)."""
    if isinstance(tensor, np.ndarray):
        return tensor.astype(dtype, copy=False)
    return tensor.to(torch_dtype(dtype))


def strided(array: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], writeable: bool = True) -> np.ndarray:
    """numpy's as_strided (strides in bytes) for any dtype: as_strided passes through an array interface, where
    ml_dtypes' float8_e5m2 is '<f1', which numpy refuses; the view is made of the bytes and given the dtype after."""
    raw = array.view(np.dtype((np.void, array.dtype.itemsize)))
    return np.lib.stride_tricks.as_strided(raw, shape, strides, writeable=writeable).view(array.dtype)


def finite(array: np.ndarray) -> bool:
    """Whether a floating-point array holds no NaN or Inf (any other dtype: True): its bits with the sign cleared,
    a slice at a time, all below the exponent's. numpy's own min and max of bfloat16 run ten times slower."""
    if array.dtype.name not in _EXPONENT or not array.size:
        return True
    bits, exponent = _EXPONENT[array.dtype.name]
    sign_cleared = np.iinfo(bits).max >> 1
    flat = array.reshape(-1).view(bits)
    buffer = np.empty(min(flat.size, _SCAN), dtype=bits)
    for start in range(0, flat.size, _SCAN):
        part = flat[start : start + _SCAN]
        masked = np.bitwise_and(part, sign_cleared, out=buffer[: part.size])
        if masked.max() >= exponent:
            return False
    return True


# Elements a lookup handles at a time: its index and operands stay in the cache.
LOOKUPS_AT_ONCE = 1 << 18
# Each bf16 value's float8_e4m3fn (round to nearest even, as ml_dtypes' cast), by its 16 bits. An fp32 value rounds
# as its top 16 bits with the lowest set where any of the 16 below is (a sticky bit): every float8_e4m3fn value and
# every midpoint between two is a bf16 value with that bit clear, so the two lie between the same midpoints. 64 KiB.
with np.errstate(invalid="ignore", over="ignore"):  # the NaN patterns (and Inf), which stay NaN
    E4M3_OF_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32).astype(float8_e4m3fn).view(np.uint8)


def to_e4m3(values: np.ndarray) -> np.ndarray:
    """fp32 `values` (contiguous) cast to float8_e4m3fn as ml_dtypes casts them, by a lookup of their top 16 bits
    with a sticky bit, a slice at a time: the cast itself takes five times as long."""
    bits = values.reshape(-1).view(np.uint32)
    codes = np.empty(bits.size, dtype=np.uint8)
    index, below = np.empty(min(bits.size, LOOKUPS_AT_ONCE), dtype=np.intp), np.empty(min(bits.size, LOOKUPS_AT_ONCE), dtype=np.uint32)
    for first in range(0, bits.size, LOOKUPS_AT_ONCE):
        part = bits[first : first + LOOKUPS_AT_ONCE]
        top, sticky = index[: part.size], below[: part.size]
        np.bitwise_and(part, 0xFFFF, out=sticky)
        np.add(sticky, 0xFFFF, out=sticky)
        np.right_shift(sticky, 16, out=sticky)  # 1 where any of the low 16 bits is set
        np.right_shift(part, 16, out=top, dtype=np.intp)
        np.bitwise_or(top, sticky, out=top, dtype=np.intp)
        np.take(E4M3_OF_BF16, top, out=codes[first : first + part.size])
    return codes.view(float8_e4m3fn).reshape(values.shape)


# float8_e4m3fn's sign, exponent and mantissa moved to the top of fp32's: as fp32, each finite value times 2^-120
# (a subnormal one as an fp32 subnormal), exact. Its scale times 2^120 (exact below 2^8) gives the value times the
# scale rounded once, as the fp32 product of the two is.
E4M3_SHIFT, E4M3_MASK, E4M3_UNBIAS = 20, np.array(0x87F00000, dtype=np.uint32).view(np.int32), np.float32(2.0**120)


def e4m3_blocks(stripes: np.ndarray, factors: np.ndarray) -> np.ndarray | None:
    """`stripes` [n, block rows, columns] of float8_e4m3fn times `factors` [n, blocks a row] (the scales times 2^120),
    as fp32, each step one numpy call over them all (a slice's worth: mconvert.slices); None where a value is NaN
    (S.1111.111), which the bits would give as a number."""
    count, block_rows, cols = stripes.shape
    codes = stripes.view(np.int8)
    if (codes & np.int8(0x7F)).max(initial=0) == 0x7F:
        return None
    bits = np.left_shift(codes, E4M3_SHIFT, dtype=np.int32)
    np.bitwise_and(bits, E4M3_MASK, out=bits)
    values = bits.view(np.float32)
    blocked = values.reshape(count, block_rows, factors.shape[-1], -1)
    blocked *= factors[:, None, :, None]
    return values


def lookup(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """`table[index]`, a slice of LOOKUPS_AT_ONCE at a time: numpy's take widens the whole index to intp first, eight
    bytes an element in fresh memory, where a slice's stays in the cache."""
    flat = index.reshape(-1)
    out = np.empty(flat.size, dtype=table.dtype)
    wide = np.empty(min(flat.size, LOOKUPS_AT_ONCE), dtype=np.intp)
    for first in range(0, flat.size, LOOKUPS_AT_ONCE):
        part = flat[first : first + LOOKUPS_AT_ONCE]
        index_part = wide[: part.size]
        np.copyto(index_part, part)
        np.take(table, index_part, out=out[first : first + part.size])
    return out.reshape(index.shape)


# Rows and columns `transposed` copies at a time: a tile of each, read and written, stays in the first-level cache.
_TILE = 128


def transposed(array: np.ndarray) -> np.ndarray:
    """A contiguous copy of `array` with its last two axes swapped, a tile at a time: numpy's copy of the swapped
    view walks the source a column at a time, three times slower on an expert's weight (gpt-oss's MXFP4 experts are
    stored as transformers' weights transposed)."""
    *lead, rows, cols = array.shape
    if rows <= _TILE or cols <= _TILE or array.swapaxes(-1, -2).flags.c_contiguous:  # small, or a view of the transpose
        return np.ascontiguousarray(array.swapaxes(-1, -2))
    source = array.reshape(-1, rows, cols)
    out = np.empty((len(source), cols, rows), dtype=array.dtype)
    for matrix, target in zip(source, out):
        for first_row in range(0, rows, _TILE):
            for first_col in range(0, cols, _TILE):
                target[first_col : first_col + _TILE, first_row : first_row + _TILE] = matrix[first_row : first_row + _TILE, first_col : first_col + _TILE].T
    return out.reshape(*lead, cols, rows)


# numpy's dtypes that torch's `.numpy()` does not give, with the signed integer of their width, whose bits both share.
_THROUGH_BITS = {"bfloat16": "int16", "float8_e4m3fn": "int8", "float8_e5m2": "int8", "float8_e8m0fnu": "int8"}


def as_numpy(tensor: Any) -> np.ndarray:
    """A CPU torch tensor's memory as a numpy array of its dtype, or an array as it is."""
    if isinstance(tensor, np.ndarray):
        return tensor
    dtype = dtype_of(tensor.dtype)
    tensor = tensor.detach()
    if dtype.name not in _THROUGH_BITS:
        return tensor.numpy()
    import torch

    return tensor.view(getattr(torch, _THROUGH_BITS[dtype.name])).numpy().view(dtype)


def as_torch(array: np.ndarray):
    """A numpy array's memory as a torch tensor of its dtype (imports torch)."""
    import torch

    if array.dtype.name not in _THROUGH_BITS:
        return torch.from_numpy(array)
    bits = np.ascontiguousarray(array).view(_THROUGH_BITS[array.dtype.name])
    return torch.from_numpy(bits).view(torch_dtype(array.dtype))
