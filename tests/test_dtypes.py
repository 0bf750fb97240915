"""hf-to-mcore's numpy arithmetic against torch's, bit for bit: casts between the weights' dtypes (round to nearest even,
ties, subnormals, overflow), FP8, MXFP4 and pack-quantized INT4 dequantized, and the finite check on every float dtype."""

import numpy as np
import pytest
import torch

from mconvert import dtypes
from mconvert.formats.quantized import dequantize_fp8_blocks, dequantize_int4, dequantize_mxfp4


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


@pytest.mark.parametrize("scale", [1e-3, 1e-38, 170.0, 256.0])  # products fp32 subnormals; the largest scale rebuilt from bits; cast
def test_fp8_whole_blocks_dequantize_as_torch_does(scale):
    """Whole 128 x 128 blocks, rebuilt from their bits: every float8_e4m3fn byte but NaN in each block, one block's
    bytes with a NaN (then cast, as the bits would give it as a number)."""
    rng = np.random.default_rng(4)
    codes = rng.permuted(np.tile(np.arange(256, dtype=np.uint8), (256, 2)), axis=1)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = torch.from_numpy((rng.random((2, 4), dtype=np.float32) + 0.5) * np.float32(scale))
    for bad in (None, (200, 300)):
        if bad:
            codes[bad] = 0xFF
        weight = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)
        ours = dequantize_fp8_blocks(dtypes.as_numpy(weight), scales.numpy(), (128, 128))
        theirs = weight.float() * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert np.array_equal(ours, theirs.numpy(), equal_nan=True) and np.isnan(ours).sum() == (bad is not None)


def test_fp32_to_e4m3_casts_as_torch_does():
    """`dtypes.to_e4m3` (a lookup of the top 16 bits and a sticky bit) against torch's cast, within +-448: awkward
    values, each float8_e4m3fn value, the midpoints between neighbours and the fp32 values either side of them."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    midpoints = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    values = torch.cat([torch.from_numpy(awkward_fp32()), grid, midpoints, midpoints.nextafter(grid[1:]), midpoints.nextafter(grid[:-1])])
    values = values.clamp(-448, 448)
    ours = dtypes.to_e4m3(values.numpy())
    assert ours.view(np.uint8).tobytes() == values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("shape", [(300, 260), (2, 129, 640), (5, 128)])
def test_transposed_swaps_the_last_two_axes(shape):
    values = np.random.default_rng(5).standard_normal(shape, dtype=np.float32).astype(dtypes.bfloat16)
    ours = dtypes.transposed(values)
    assert ours.flags.c_contiguous and ours.shape == values.swapaxes(-1, -2).shape
    assert ours.view(np.uint16).tobytes() == np.ascontiguousarray(values.swapaxes(-1, -2)).view(np.uint16).tobytes()


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (2, 6, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (2, 6, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    ours = np.ascontiguousarray(dequantize_mxfp4(blocks, scales).swapaxes(-1, -2))
    assert ours.view(np.uint16).tobytes() == dtypes.as_numpy(theirs.contiguous()).view(np.uint16).tobytes()


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("strategy, shape", [("group", (40, 96)), ("channel", (40, 96)), ("channel", (24, 20))])
def test_pack_quantized_int4_dequantizes_as_compressed_tensors_does(strategy, shape, symmetric, scale_dtype):
    """compressed-tensors packs a weight (its own scales and zero points, of min-max per group of 32 or per row, 20
    columns leaving a part-filled word) and decompresses it: the numpy dequantization gives the same bits, in the
    scales' dtype."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=32 if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    weight = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.1).to(scale_dtype)
    groups = weight.unflatten(-1, (-1, 32)) if strategy == "group" else weight.unsqueeze(1)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    stored = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point.to(torch.int8)}, scheme)
    theirs = PackedQuantizationCompressor.decompress(dict(stored), scheme)["weight"]
    zero_points = None if symmetric else stored["weight_zero_point"].numpy()
    ours = dequantize_int4(stored["weight_packed"].numpy(), dtypes.as_numpy(stored["weight_scale"]), shape[1], zero_points)
    assert ours.dtype == dtypes.dtype_of(theirs.dtype) and ours.tobytes() == dtypes.as_numpy(theirs).tobytes()


@pytest.mark.parametrize("name", ["float64", "float32", "float16", "bfloat16"])
def test_finite_finds_one_nan_or_inf_anywhere(name):
    values = np.zeros(200_000, dtype=np.float32).astype(dtypes.BY_NAME[name])
    assert dtypes.finite(values)
    for bad in (np.inf, -np.inf, np.nan):
        for place in (0, 65_535, 65_536, 199_999):  # either side of a scanned slice's edge
            faulty = values.copy()
            faulty[place] = bad
            assert not dtypes.finite(faulty), (bad, place)
    assert dtypes.finite(np.full(7, 65504, dtype=np.float16)) and dtypes.finite(np.array([], dtype=dtypes.bfloat16))
