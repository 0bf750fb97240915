"""`mcore-to-hf --quantize as-source`: the export of a block-quantized FP8 release (DeepSeek-V3's format) in that
format, held bit for bit to a reference quantizer.

The reference is compressed-tensors' block FP8 quantization (`QuantizationStrategy.BLOCK`, `calculate_qparams` then
`quantize`), what llm-compressor's FP8_BLOCK scheme writes and vLLM serves: per block scale = amax / 448 in fp32,
w / scale clamped to +-448 and cast to float8_e4m3fn (round to nearest even), w = q * scale; the same arithmetic
as DeepSeek-V3's own `act_quant` kernel, and the same convention as the release's `weight_scale_inv` (the factor
that dequantizes). transformers' `Fp8Quantize` is not the reference: it multiplies by 448 / amax and stores the
reciprocal (two roundings, so its scales can differ by an ulp), and it leaves tensors with partial blocks
unquantized, where a release (and this test's blocks of 16 x 32) quantizes them. The reference is given fp32
values (a bf16 export's upcast exactly): compressed-tensors computes a bf16 weight's scale in bf16, where a
release's scales are fp32."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mconvert.dtypes import as_torch
from mconvert import dtypes
from mconvert.cli import main
from mconvert.converters import quantized_export
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.quantized import dequantize_fp8_blocks, quantize_fp8_blocks
from mconvert.full_size import is_fp8_on_the_hub
from mconvert.mcore.checkpoint import RELEASE
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli

# Smaller than the hub's 128 x 128 and not square, so that the test's widths span several blocks, some partial.
BLOCK = (16, 32)
QUANTIZATION = {**real_config("deepseek-v3")["quantization_config"], "weight_block_size": list(BLOCK)}
# A tensor of the release whose block (0, 0) is zeros and block (1, 0) holds values of at most 224: not a block the
# reference quantizer makes (its largest |q| is 448), as a release edited after quantizing might hold.
EDITED = "model.layers.1.self_attn.o_proj.weight"


def reference_quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale per block) by compressed-tensors, from the weight's values in fp32."""
    args = QuantizationArgs(num_bits=8, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.BLOCK, symmetric=True, block_structure=list(block))
    values = weight.float()
    padded = maybe_pad_tensor_for_block_quant(values, block)  # zeros: a partial block's amax is its values'
    blocked = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale, zero_point = calculate_qparams(blocked.amin(dim=(1, 3)), blocked.amax(dim=(1, 3)), args)
    return quantize(values, scale, zero_point, args, dtype=torch.float8_e4m3fn).contiguous(), scale


def dequantize(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    factors = scale.repeat_interleave(BLOCK[0], 0)[: quantized.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : quantized.shape[1]]
    return quantized.float() * factors


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def headers(directory) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape, from the safetensors headers."""
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            found.update({name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()})
    return found


def tensors(directory) -> dict[str, torch.Tensor]:
    return {name: t for path in sorted(directory.glob("*.safetensors")) for name, t in load_file(path).items()}


def release_from(tensors_in: dict[str, torch.Tensor], directory, config: dict) -> None:
    directory.mkdir()
    save_file(tensors_in, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A shrunk DeepSeek-V3 FP8 release quantized by the reference (one tensor edited, see EDITED), converted to
    Megatron (fp32, TP 2), and exported: `plain-32`/`plain-16` (fp32, bf16) unquantized, `fp8-32`/`fp8-16` with
    --quantize as-source."""
    root = tmp_path_factory.mktemp("fp8-export")
    source = make_hf_checkpoint(shrink(real_config("deepseek-v3")), root / "source")
    weights = load_file(source / "model.safetensors")
    release = dict(weights)
    for name, tensor in weights.items():
        if is_fp8_on_the_hub(name):
            release[name], release[name + "_scale_inv"] = reference_quantize(tensor)
    edited = release[EDITED].float()
    edited[: BLOCK[0], : BLOCK[1]] = 0
    edited[BLOCK[0] : 2 * BLOCK[0], : BLOCK[1]] /= 2  # exact in float8_e4m3fn but for the smallest values
    release[EDITED] = edited.to(torch.float8_e4m3fn)
    config = {**json.loads((source / "config.json").read_text()), "quantization_config": QUANTIZATION}
    release_from(release, root / "release", config)
    convert_hf_to_mcore(root / "release", root / "mcore", parallelism=Parallelism(tp=2), dtype=torch.float32)
    for name, dtype in (("32", torch.float32), ("16", torch.bfloat16)):
        convert_mcore_to_hf(root / "mcore", root / f"plain-{name}", hf_config_dir=root / "release", dtype=dtype)
    assert main(["mcore-to-hf", "--load-dir", str(root / "mcore"), "--save-dir", str(root / "fp8-32"), "--hf-config", str(root / "release"), "--quantize", "as-source"]) == 0
    convert_mcore_to_hf(root / "mcore", root / "fp8-16", hf_config_dir=root / "release", dtype=torch.bfloat16, quantize="as-source")
    return root


def test_the_export_has_the_releases_tensors_and_quantization_config(work):
    assert headers(work / "fp8-32") == headers(work / "release")
    assert sum(name.endswith("_scale_inv") for name in headers(work / "release")) > 20
    assert json.loads((work / "fp8-32" / "config.json").read_text())["quantization_config"] == QUANTIZATION
    assert "quantization_config" not in json.loads((work / "plain-32" / "config.json").read_text())


def mismatches(fp8_dir, plain_dir) -> list[str]:
    """The tensors of an FP8 export that are not the reference quantizer's output (bytes and scales) for the
    unquantized export's tensor, or, unquantized, not that tensor."""
    fp8, plain = tensors(fp8_dir), tensors(plain_dir)
    wrong = sorted(set(plain) ^ {name for name in fp8 if not name.endswith("_scale_inv")})
    for name, tensor in plain.items():
        if name + "_scale_inv" in fp8:
            q, scale = reference_quantize(tensor)
            if not (torch.equal(bits(fp8[name]), bits(q)) and torch.equal(fp8[name + "_scale_inv"], scale)):
                wrong.append(name)
        elif name in fp8 and not torch.equal(fp8[name], tensor):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("dtype", ["32", "16"])
def test_each_fp8_tensor_is_the_reference_quantizers_output_bit_for_bit(work, dtype):
    assert mismatches(work / f"fp8-{dtype}", work / f"plain-{dtype}") == []
    assert tensors(work / f"fp8-{dtype}")[EDITED + "_scale_inv"][0, 0] == torch.finfo(torch.float32).eps  # a block of zeros


@pytest.mark.parametrize("fault", ["inverted scale", "one scale a tensor"])
def test_a_wrong_quantizer_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: a quantizer storing 448 / amax (the multiplier that quantizes, not the one that
    dequantizes), or taking one amax for the whole tensor, fails the reference check."""
    right = quantized_export.quantize_fp8_blocks

    def wrong(values, block):
        if fault == "one scale a tensor":
            quantized, scales = right(values, values.shape[-2:])
            return quantized, scales.repeat(-(-values.shape[-2] // block[0]), -2).repeat(-(-values.shape[-1] // block[1]), -1)
        quantized, scales = right(values, block)
        return quantized, (1 / scales).astype(scales.dtype)

    monkeypatch.setattr(quantized_export, "quantize_fp8_blocks", wrong)
    convert_mcore_to_hf(work / "mcore", tmp_path / "fp8", hf_config_dir=work / "release", dtype=torch.float32, quantize="as-source")
    assert len(mismatches(tmp_path / "fp8", work / "plain-32")) > 20


def test_the_round_trip_gives_back_the_releases_bytes_where_a_blocks_largest_value_is_448(work):
    """FP8 release -> hf-to-mcore (fp32) -> mcore-to-hf --quantize as-source: a block whose largest |q| is 448 (every
    block the reference quantizer makes) comes back with its bytes, and with its scale where that is amax / 448 in
    fp32 as here (other scales: the test below); a block of zeros too. A block whose largest |q| is less (224 here)
    comes back as the same values, requantized: its scale is the one that makes its largest value 448 (half the
    release's), and its bytes differ."""
    release, back = tensors(work / "release"), tensors(work / "fp8-32")
    rows, cols = slice(BLOCK[0], 2 * BLOCK[0]), slice(0, BLOCK[1])
    for name, tensor in release.items():
        if name.startswith(EDITED):
            continue
        assert torch.equal(bits(back[name]), bits(tensor)), name
    q, scale = release[EDITED], release[EDITED + "_scale_inv"]
    q_back, scale_back = back[EDITED], back[EDITED + "_scale_inv"]
    assert q[rows, cols].float().abs().max() == 224
    assert scale_back[1, 0] == scale[1, 0] / 2 and not torch.equal(bits(q_back[rows, cols]), bits(q[rows, cols]))
    assert torch.equal(dequantize(q_back, scale_back), dequantize(q, scale))
    unchanged = torch.ones(scale.shape, dtype=torch.bool)
    unchanged[:2, 0] = False
    assert torch.equal(scale_back[unchanged], scale[unchanged]) and torch.equal(bits(q_back[2 * BLOCK[0] :]), bits(q[2 * BLOCK[0] :]))
    assert torch.equal(bits(q_back[: BLOCK[0]]), bits(q[: BLOCK[0]])) and q_back[: BLOCK[0], : BLOCK[1]].float().abs().max() == 0


def test_scales_computed_otherwise_come_back_within_one_ulp_and_the_bytes_exactly():
    """A release whose scales were computed as transformers' Fp8Quantize computes them, 1 / (448 / amax) in fp32,
    not amax / 448: dequantized in fp32 and quantized again, every block's bytes come back, its scale within one
    ulp (here about one in eight differs), since a scale one ulp off moves no value of |q| <= 448 to another
    float8_e4m3fn."""
    rng = np.random.default_rng(1)
    grid = (40, 20)
    blocked = (rng.standard_normal((grid[0], BLOCK[0], grid[1], BLOCK[1])) * 0.05).astype(np.float32)
    scale = np.float32(448) / np.abs(blocked).max(axis=(1, 3))
    scale_inv = np.float32(1) / scale
    q = np.clip(blocked * scale[:, None, :, None], -448, 448).astype(dtypes.float8_e4m3fn).reshape(grid[0] * BLOCK[0], -1)
    q_back, scale_back = quantize_fp8_blocks(dequantize_fp8_blocks(q, scale_inv, BLOCK), BLOCK)
    assert np.array_equal(q_back.view(np.uint8), q.view(np.uint8))
    ulps = np.abs(scale_back.view(np.int32) - scale_inv.view(np.int32))
    assert ulps.max() == 1 and 0.05 < (ulps == 1).mean() < 0.25


def test_the_fp8_export_converts_as_its_dequantized_values(work, tmp_path):
    """The export is a valid input: hf-to-mcore of it equals hf-to-mcore of its tensors dequantized by this test."""
    fp8 = tensors(work / "fp8-32")
    plain = {name: dequantize(t, fp8[name + "_scale_inv"]) if name + "_scale_inv" in fp8 else t for name, t in fp8.items() if not name.endswith("_scale_inv")}
    config = json.loads((work / "fp8-32" / "config.json").read_text())
    release_from(plain, tmp_path / "plain", {k: v for k, v in config.items() if k != "quantization_config"})
    for name in ("fp8", "plain"):
        convert_hf_to_mcore(work / "fp8-32" if name == "fp8" else tmp_path / "plain", tmp_path / f"{name}-mcore", parallelism=Parallelism(tp=2), dtype=torch.float32)
    stores = [DCPCheckpoint(tmp_path / f"{name}-mcore" / RELEASE) for name in ("fp8", "plain")]
    assert sorted(stores[0].shapes) == sorted(stores[1].shapes)
    for key, shape in stores[1].shapes.items():
        assert torch.equal(*(as_torch(store.read_region(key, (0,) * len(shape), shape)) for store in stores)), key


def test_quantize_without_hf_config_is_one_line(work, tmp_path):
    result = run_cli("mcore-to-hf", "--load-dir", work / "mcore", "--save-dir", tmp_path / "out", "--quantize", "as-source")
    assert_one_line_error(result, "--quantize as-source needs --hf-config")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("source", ["unquantized", "awq", "ue8m0", "config only", "other value"])
def test_quantize_of_a_source_not_fp8_blocks_is_one_line(work, source, tmp_path, capsys):
    """Of FP8, only block-quantized FP8 with fp32 scales is written back; of the rest only pack-quantized INT4
    (test_int4_export.py) and MXFP4 (test_mxfp4_export.py): any other --hf-config original (or one without its weights' headers, or another --quantize
    value) is refused in one line, nothing written."""
    original = tmp_path / "original"
    shutil.copytree(work / "release", original)
    if source == "config only":
        (original / "model.safetensors").unlink()
    config = json.loads((original / "config.json").read_text())
    quantization = {
        "unquantized": None, "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
        "ue8m0": {**QUANTIZATION, "scale_fmt": "ue8m0"},
        "config only": QUANTIZATION, "other value": QUANTIZATION,
    }[source]
    (original / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    flag = "per-tensor" if source == "other value" else "as-source"
    code = main(["mcore-to-hf", "--load-dir", str(work / "mcore"), "--save-dir", str(tmp_path / "out"), "--hf-config", str(original), "--quantize", flag])
    err = capsys.readouterr().err.strip()
    if source == "unquantized":  # FP8 tensors under a config that names no FP8 blocks: refused first
        assert code == 1 and len(err.splitlines()) == 1 and str(original / "model.safetensors") in err, err
        assert "is FP8 but config.json's quantization_config names no weight_block_size" in err, err
        return assert_nothing_left(tmp_path / "out")
    if source == "awq":  # a quantization mconvert reads in no direction: refused as the original is opened
        assert code == 1 and len(err.splitlines()) == 1 and "'quant_method': 'awq'" in err and "is not supported" in err, err
        return assert_nothing_left(tmp_path / "out")
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("mconvert: error: --quantize"), err
    expected = {"unquantized": "not quantized", "awq": "quant_method awq",
                "ue8m0": "scale_fmt ue8m0", "config only": "has no model.safetensors.index.json or model.safetensors",
                "other value": "not one of as-source"}[source]
    assert expected in err and ("not supported yet" in err or source in ("config only", "other value")), err
    assert_nothing_left(tmp_path / "out")
