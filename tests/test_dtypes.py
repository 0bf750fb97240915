"""The way in's numpy arithmetic against torch's, bit for bit: casts between the weights' dtypes (round to nearest even,
ties, subnormals, overflow), FP8 and MXFP4 dequantized, and the finite check on every float dtype."""

import numpy as np
import pytest
import torch

from mconvert import dtypes
from mconvert.formats.quantized import dequantize_fp8_blocks, dequantize_mxfp4


def awkward_fp32(count: int = 1 << 16) -> np.ndarray:
    """fp32 values of every kind: random bits (subnormals, huge, negative), bf16/fp16 ties (the half-way bit set)."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, size=count, dtype=np.uint64).astype(np.uint32)
    bits[::3] = (bits[::3] & 0xFFFF0000) | 0x8000  # exactly half-way between two bf16 values
    values = bits.view(np.float32)
    return values[np.isfinite(values)]


@pytest.mark.parametrize("source", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("target", ["float32", "bfloat16", "float16"])
def test_casts_equal_torchs(source, target):
    start = torch.from_numpy(awkward_fp32()).to(dtypes.torch_dtype(dtypes.BY_NAME[source]))
    ours = dtypes.as_numpy(start).astype(dtypes.BY_NAME[target])
    theirs = start.to(dtypes.torch_dtype(dtypes.BY_NAME[target]))
    assert ours.view(np.uint8).tobytes() == dtypes.as_numpy(theirs).view(np.uint8).tobytes()


def test_fp8_blocks_dequantize_as_torch_does():
    rng = np.random.default_rng(1)
    weight = torch.from_numpy(rng.standard_normal((300, 260), dtype=np.float32)).to(torch.float8_e4m3fn)  # partial blocks
    scales = torch.from_numpy(rng.random((3, 3), dtype=np.float32))
    ours = dequantize_fp8_blocks(dtypes.as_numpy(weight), scales.numpy(), (128, 128))
    factors = scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert np.array_equal(ours, (weight.float() * factors).numpy())


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (2, 6, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (2, 6, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    ours = np.ascontiguousarray(dequantize_mxfp4(blocks, scales).swapaxes(-1, -2))
    assert ours.view(np.uint16).tobytes() == dtypes.as_numpy(theirs.contiguous()).view(np.uint16).tobytes()


@pytest.mark.parametrize("name", ["float64", "float32", "float16", "bfloat16"])
def test_finite_finds_one_nan_or_inf_anywhere(name):
    values = np.zeros(200_000, dtype=np.float32).astype(dtypes.BY_NAME[name])
    assert dtypes.finite(values)
    for bad in (np.inf, -np.inf, np.nan):
        for place in (0, 65_535, 65_536, 199_999):  # either side of a scanned slice's edge
            planted = values.copy()
            planted[place] = bad
            assert not dtypes.finite(planted), (bad, place)
    assert dtypes.finite(np.full(7, 65504, dtype=np.float16)) and dtypes.finite(np.array([], dtype=dtypes.bfloat16))
