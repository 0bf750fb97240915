"""A large tensor's (de)quantization split into slices of rows on threads (mconvert.slices) gives what one slice on
one thread gives, bit for bit, in every format and direction: shapes whose rows are not a multiple of the block
(FP8's 128) or of the slice, slices cut to a few rows so that each tensor is many, on 3 threads. The results of one
slice are those the tests against torch, compressed-tensors and transformers check (test_fp8.py, test_int4.py,
test_mxfp4_export.py...)."""

from __future__ import annotations

import numpy as np
import pytest

from mconvert import dtypes, slices
from mconvert.formats import fp8_source, quantized

RNG = np.random.default_rng(0)


def fp8(shape: tuple[int, ...], nan: bool = False) -> np.ndarray:
    codes = RNG.integers(0, 256, shape, dtype=np.uint8)
    if not nan:
        codes[(codes & 0x7F) == 0x7F] = 0x7E
    return codes.view(dtypes.float8_e4m3fn)


def int4(rows: int, columns: int, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    packed = RNG.integers(-(1 << 31), 1 << 31, (rows, -(-columns // 8)), dtype=np.int64).astype(np.int32)
    zeros = RNG.integers(-(1 << 31), 1 << 31, (-(-rows // 8), groups), dtype=np.int64).astype(np.int32)
    return packed, RNG.uniform(1e-3, 1e-2, (rows, groups)).astype(dtypes.bfloat16), zeros


def kernels() -> dict:
    """Each kernel on its inputs, by name: FP8 rows 300 and 2 x 200 (blocks of 128: partial ones), a NaN taking the
    cast in some slices; INT4 of 301 rows, zero points too; MXFP4 of 3 x 37 rows; each export on the source's
    scales too, some values changed."""
    block = (128, 128)
    weight, weights = fp8((300, 260)), fp8((2, 200, 256), nan=True)
    scales, grid = RNG.uniform(1e-3, 2e-3, (3, 3)).astype(np.float32), RNG.uniform(1e-3, 2e-3, (2, 2, 2)).astype(np.float32)
    values = quantized.dequantize_fp8_blocks(weight, scales, block, dtypes.bfloat16)
    kept = values.copy()  # the first block row changed, the rest as the release's scales give them
    kept[:100] *= dtypes.bfloat16.type(0.75)
    values[::7] *= dtypes.bfloat16.type(0.75)
    packed, int4_scales, zeros = int4(301, 96, 3)
    int4_values = quantized.dequantize_int4(packed, int4_scales, 96)
    int4_values[::5] *= dtypes.bfloat16.type(0.75)
    blocks, exponents = RNG.integers(0, 256, (3, 37, 4, 16), dtype=np.uint8), RNG.integers(118, 131, (3, 37, 4), dtype=np.uint8)
    mxfp4_values = quantized.dequantize_mxfp4(blocks, exponents)
    mxfp4_values[:, ::3] *= dtypes.bfloat16.type(0.75)
    return {
        "FP8 in, fp32": lambda: quantized.dequantize_fp8_blocks(weight, scales, block),
        "FP8 in, bf16": lambda: quantized.dequantize_fp8_blocks(weights, grid, block, dtypes.bfloat16),
        "FP8 out": lambda: quantized.quantize_fp8_blocks(values, block),
        "FP8 out, power-of-two scales": lambda: quantized.quantize_fp8_blocks(values, block, power_of_two=True),
        "FP8 out on the source's scales": lambda: fp8_source.quantize_fp8_on_source(kept, block, scales),
        "INT4 in": lambda: quantized.dequantize_int4(packed, int4_scales, 96),
        "INT4 in, zero points": lambda: quantized.dequantize_int4(packed, int4_scales, 96, zeros),
        "INT4 out": lambda: quantized.quantize_int4(int4_values, 32, dtypes.bfloat16),
        "INT4 out on the source's scales": lambda: quantized.quantize_int4(int4_values, 32, dtypes.bfloat16, int4_scales),
        "MXFP4 in": lambda: quantized.dequantize_mxfp4(blocks, exponents),
        "MXFP4 out": lambda: quantized.quantize_mxfp4(mxfp4_values),
        "MXFP4 out on the source's scales": lambda: quantized.quantize_mxfp4(mxfp4_values, exponents),
    }


KERNELS = kernels()


def as_bytes(result) -> list[tuple[str, tuple[int, ...], bytes]]:
    results = result if isinstance(result, tuple) else (result,)
    return [(array.dtype.name, array.shape, np.ascontiguousarray(array).tobytes()) for array in results]


@pytest.mark.parametrize("name", list(KERNELS))
def test_slices_on_threads_give_the_one_slice_result(name, monkeypatch):
    whole = as_bytes(KERNELS[name]())  # the slices hold whole tensors here: one slice each
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", 1000)  # a few rows (FP8: one block row) a slice
    assert len(slices.row_slices(300, 260, 128)) == 3 and len(slices.row_slices(301, 96)) == 31
    with slices.threads(3):
        assert as_bytes(KERNELS[name]()) == whole


@pytest.mark.parametrize("name", ["FP8 in, fp32", "FP8 out"])
def test_slices_that_cut_blocks_are_caught(name, monkeypatch):
    """Fault injection: FP8 slices of 100 rows, cutting the blocks of 128 (the block row size ignored), change the
    results: a slice's scales are those of the blocks it starts in."""
    whole = as_bytes(KERNELS[name]())
    cut = slices.row_slices
    monkeypatch.setattr(slices, "row_slices", lambda rows, row_elements, align=1: cut(rows, row_elements * 128 // 100))
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", 128 * 260)
    assert [part.stop for part in slices.row_slices(300, 260, 128)] == [100, 200, 300]
    with slices.threads(3):
        assert as_bytes(KERNELS[name]()) != whole


def test_a_failing_slice_is_raised_once_the_others_stop():
    done = []

    def work(item: int) -> None:
        if item == 2:
            raise ValueError("slice 2")
        done.append(item)

    with slices.threads(3), pytest.raises(ValueError, match="slice 2"):
        slices.run(work, list(range(6)))
    assert sorted(done) == [0, 1, 3, 4, 5]
    assert slices._state == {"pool": None, "users": 0}
