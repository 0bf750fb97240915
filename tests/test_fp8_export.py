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
release's scales are fp32.

A block whose values are exactly float8_e4m3fn values times the release's own scale keeps that scale, so that a
round trip gives back the release's bytes whatever rule made its scales (amax / 400 here); the other blocks are the
reference's. Power-of-two scales (`scale_fmt: ue8m0`, DeepSeek-V3.1 and V3.2) are held to DeepGEMM's
`per_block_cast_to_fp8` with `use_ue8m0` (amax / 448 rounded up to a power of two by transformers' copy of its
`ceil_to_ue8m0`), and where blocks are whole to transformers' Fp8Quantize with scale_fmt ue8m0, which also gives a
block of zeros the scale 1 (DeepGEMM clamps amax to 1e-4 first: 2^-22)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.integrations.deepgemm import _ceil_to_ue8m0
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from mconvert.dtypes import as_torch
from mconvert import dtypes
from mconvert.cli import main
from mconvert.converters import quantized_export
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats import fp8_source
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


def ue8m0_quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, power-of-two scales as float8_e8m0fnu), as DeepGEMM's `per_block_cast_to_fp8(x,
    use_ue8m0=True)` computes them (zero padding, amax / 448, rounded up to a power of two, x times its reciprocal),
    a block of zeros given the scale 1 as transformers' Fp8Quantize gives it."""
    values = weight.float()
    padded = maybe_pad_tensor_for_block_quant(values, block)
    blocked = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    amax = blocked.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, _ceil_to_ue8m0(amax / 448.0), torch.ones_like(amax))
    q = (blocked * (1.0 / scale)[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)
    return q[: values.shape[0], : values.shape[1]].contiguous(), scale.to(torch.float8_e8m0fnu)


def rule_quantize(weight: torch.Tensor, largest: float = 400.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A release quantized by another rule than the reference's: scale = amax / `largest` in fp32 (a block's
    largest |q| about `largest`, not 448), a block of zeros fp32's eps."""
    values = weight.float()
    padded = maybe_pad_tensor_for_block_quant(values, BLOCK)
    blocked = padded.reshape(padded.shape[0] // BLOCK[0], BLOCK[0], padded.shape[1] // BLOCK[1], BLOCK[1])
    amax = blocked.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / largest, torch.finfo(torch.float32).eps)
    q = (blocked / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)
    return q[: values.shape[0], : values.shape[1]].contiguous(), scale


def dequantize(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    factors = scale.repeat_interleave(BLOCK[0], 0)[: quantized.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : quantized.shape[1]]
    return quantized.float() * factors.float()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else tensor


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
    --quantize as-source. Its values (`plain-32`) quantized again by `rule_quantize` (`release-400`) and by
    `ue8m0_quantize` (`release-ue8m0`, scale_fmt ue8m0): each converted to Megatron and exported as its source
    (`back-400-32`, `back-400-16`, `back-ue8m0`), and the first Megatron checkpoint exported with them as
    --hf-config (`fresh-32`, `fresh-16`, `fresh-ue8m0`: no block of it is exact on their scales but those of zeros,
    so that every block is quantized afresh)."""
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
    values = tensors(root / "plain-32")
    for name, rule, quantization in (("400", rule_quantize, QUANTIZATION), ("ue8m0", ue8m0_quantize, {**QUANTIZATION, "scale_fmt": "ue8m0"})):
        requantized = dict(values)
        for weight, tensor in values.items():
            if is_fp8_on_the_hub(weight):
                requantized[weight], requantized[weight + "_scale_inv"] = rule(tensor)
        release_from(requantized, root / f"release-{name}", {**config, "quantization_config": quantization})
        convert_hf_to_mcore(root / f"release-{name}", root / f"mcore-{name}", parallelism=Parallelism(tp=2), dtype=torch.float32)
    for mcore, out, hf, dtype in (
        ("mcore-400", "back-400-32", "release-400", torch.float32), ("mcore-400", "back-400-16", "release-400", torch.bfloat16),
        ("mcore-ue8m0", "back-ue8m0", "release-ue8m0", torch.bfloat16), ("mcore", "fresh-32", "release-400", torch.float32),
        ("mcore", "fresh-16", "release-400", torch.bfloat16), ("mcore", "fresh-ue8m0", "release-ue8m0", torch.float32),
    ):
        convert_mcore_to_hf(root / mcore, root / out, hf_config_dir=root / hf, dtype=dtype, quantize="as-source")
    return root


def test_the_export_has_the_releases_tensors_and_quantization_config(work):
    assert headers(work / "fp8-32") == headers(work / "release")
    assert sum(name.endswith("_scale_inv") for name in headers(work / "release")) > 20
    assert json.loads((work / "fp8-32" / "config.json").read_text())["quantization_config"] == QUANTIZATION
    assert "quantization_config" not in json.loads((work / "plain-32" / "config.json").read_text())


def bits_of(directory) -> dict[str, torch.Tensor]:
    """Each tensor of a directory, float8 ones (values and float8_e8m0fnu scales) as their bytes."""
    return {name: t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t for name, t in tensors(directory).items()}


def mismatches(fp8_dir, plain_dir, reference=reference_quantize) -> list[str]:
    """The tensors of an FP8 export that are not the `reference` quantizer's output (bytes, scales and their dtype)
    for the unquantized export's tensor, or, unquantized, not that tensor."""
    fp8, plain = tensors(fp8_dir), tensors(plain_dir)
    wrong = sorted(set(plain) ^ {name for name in fp8 if not name.endswith("_scale_inv")})
    for name, tensor in plain.items():
        if name + "_scale_inv" in fp8:
            q, scale = reference(tensor)
            if not (torch.equal(bits(fp8[name]), bits(q)) and torch.equal(bits(fp8[name + "_scale_inv"]), bits(scale))):
                wrong.append(name)
        elif name in fp8 and not torch.equal(fp8[name], tensor):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("dtype", ["32", "16"])
def test_each_fp8_tensor_is_the_reference_quantizers_output_bit_for_bit(work, dtype):
    """Exported with --hf-config release-400, on whose scales no block of these values is exact (but zeros)."""
    assert mismatches(work / f"fresh-{dtype}", work / f"plain-{dtype}") == []
    assert tensors(work / f"fresh-{dtype}")[EDITED + "_scale_inv"][0, 0] == torch.finfo(torch.float32).eps  # a block of zeros


def test_ue8m0_scales_are_the_references_powers_of_two_bit_for_bit(work):
    """scale_fmt ue8m0: every block quantized afresh on amax / 448 rounded up to a power of two, its scales stored
    as the release stores them (float8_e8m0fnu); transformers' Fp8Quantize makes the same of whole blocks."""
    assert headers(work / "fresh-ue8m0") == headers(work / "release-ue8m0")
    assert headers(work / "release-ue8m0")[EDITED + "_scale_inv"][0] == "F8_E8M0"
    assert mismatches(work / "fresh-ue8m0", work / "plain-32", ue8m0_quantize) == []
    assert len(mismatches(work / "fresh-ue8m0", work / "plain-32", lambda t: reference_quantize(t)[0:1] + (ue8m0_quantize(t)[1],))) > 20
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=list(BLOCK), scale_fmt="ue8m0")))
    weight = torch.randn(4 * BLOCK[0], 8 * BLOCK[1]) * 0.05
    weight[: BLOCK[0], : BLOCK[1]] = 0
    theirs, ours = quantizer._quantize_one("w.weight", weight), quantize_fp8_blocks(weight.numpy(), BLOCK, power_of_two=True)
    assert np.array_equal(theirs["w.weight"].view(torch.uint8).numpy(), ours[0].view(np.uint8))
    assert np.array_equal(theirs["w.weight_scale_inv"].float().numpy(), ours[1])


def test_ue8m0_rounds_up_where_amax_over_448_is_just_above_a_power_of_two():
    """amax / 448 one ulp above 2^-12 (in fp32) gets 2^-11, as DeepGEMM's integer rounding gives it, so that no value
    passes 448; torch's log2 rounds that quotient to -12 (transformers' Fp8Quantize then gives 2^-12 and clamps):
    bytes made so are kept from a release (its scale is exact), never made afresh."""
    weight = np.full(BLOCK, 0.01, dtype=np.float32)
    weight[0, 0] = np.nextafter(np.float32(448 * 2.0**-12), np.float32(1))
    assert (np.float32(weight[0, 0]) / np.float32(448)).view(np.int32) == np.float32(2.0**-12).view(np.int32) + 1
    _, scales = quantize_fp8_blocks(weight, BLOCK, power_of_two=True)
    assert scales[0, 0] == _ceil_to_ue8m0(torch.tensor([weight[0, 0] / np.float32(448)]))[0] == 2.0**-11
    assert torch.exp2(torch.ceil(torch.log2(torch.tensor(weight[0, 0] / np.float32(448))))) == 2.0**-12


@pytest.mark.parametrize("fault", ["inverted scale", "one scale a tensor", "scales not rounded up"])
def test_a_wrong_quantizer_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: a quantizer storing 448 / amax (the multiplier that quantizes, not the one that
    dequantizes), taking one amax for the whole tensor, or ignoring scale_fmt ue8m0, fails the reference check."""
    right = fp8_source.quantize_fp8_blocks

    def wrong(values, block, power_of_two=False):
        if fault == "scales not rounded up":
            return right(values, block)
        if fault == "one scale a tensor":
            quantized, scales = right(values, values.shape[-2:])
            return quantized, scales.repeat(-(-values.shape[-2] // block[0]), -2).repeat(-(-values.shape[-1] // block[1]), -1)
        quantized, scales = right(values, block)
        return quantized, (1 / scales).astype(scales.dtype)

    monkeypatch.setattr(fp8_source, "quantize_fp8_blocks", wrong)
    ue8m0 = fault == "scales not rounded up"
    hf = work / ("release-ue8m0" if ue8m0 else "release-400")
    convert_mcore_to_hf(work / "mcore", tmp_path / "fp8", hf_config_dir=hf, dtype=torch.float32, quantize="as-source")
    assert len(mismatches(tmp_path / "fp8", work / "plain-32", ue8m0_quantize if ue8m0 else reference_quantize)) > 20


@pytest.mark.parametrize("release, export", [("release", "fp8-32"), ("release", "fp8-16"), ("release-400", "back-400-32"), ("release-400", "back-400-16"), ("release-ue8m0", "back-ue8m0")])
def test_the_round_trip_gives_back_every_byte_of_the_release(work, release, export):
    """Release -> hf-to-mcore (fp32) -> mcore-to-hf --quantize as-source (fp32 or bf16): every tensor byte for byte,
    each block keeping the release's scale and bytes, whichever rule made them: the reference's (amax / 448), its
    EDITED blocks (one of zeros, one whose largest |q| is 224), amax / 400, or powers of two (float8_e8m0fnu). (A
    bf16 export holds the test release's unquantized fp32 tensors in bf16: its FP8 tensors and scales are compared.)"""
    original, back = bits_of(work / release), bits_of(work / export)
    assert original.keys() == back.keys()
    compared = [name for name in original if export.endswith("32") or name.endswith("_scale_inv") or name + "_scale_inv" in original]
    assert len(compared) > 40 and [name for name in compared if not torch.equal(back[name], original[name])] == []


def test_without_the_releases_scales_other_rules_do_not_come_back(work):
    """What keeping the release's scales is for: quantized afresh (amax / 448), no block of release-400 but those of
    zeros keeps its scale, and the reference release's EDITED block of largest |q| 224 gets half its scale."""
    release = tensors(work / "release-400")
    for name in [n.removesuffix("_scale_inv") for n in release if n.endswith("_scale_inv") and not n.startswith(EDITED)]:
        _, scale = quantize_fp8_blocks(dequantize(release[name], release[name + "_scale_inv"]).numpy(), BLOCK)
        assert not np.equal(scale, release[name + "_scale_inv"].numpy()).any(), name
    original = tensors(work / "release")
    q, scale = quantize_fp8_blocks(dequantize(original[EDITED], original[EDITED + "_scale_inv"]).numpy(), BLOCK)
    assert scale[1, 0] == original[EDITED + "_scale_inv"][1, 0] / 2 and original[EDITED][BLOCK[0] : 2 * BLOCK[0], : BLOCK[1]].float().abs().max() == 224


@pytest.mark.parametrize("fault", ["no block kept", "every block kept"])
def test_a_wrong_choice_of_kept_blocks_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: keeping no block of the release (quantizing all afresh) loses release-400's bytes; keeping
    every block, exact or not, gives blocks of other values than the Megatron checkpoint's (the fresh export's)."""
    right = fp8_source.fp8_on_scales

    def wrong(values, scales, block):
        kept, exact = right(values, scales, block)
        return kept, np.full_like(exact, fault == "every block kept")

    monkeypatch.setattr(fp8_source, "fp8_on_scales", wrong)
    mcore, reference = ("mcore-400", "release-400") if fault == "no block kept" else ("mcore", "fresh-32")
    convert_mcore_to_hf(work / mcore, tmp_path / "fp8", hf_config_dir=work / "release-400", dtype=torch.float32, quantize="as-source")
    expected, back = bits_of(work / reference), bits_of(tmp_path / "fp8")
    assert len([name for name, t in expected.items() if not torch.equal(back[name], t)]) > 20


def test_scales_computed_otherwise_come_back_within_one_ulp_and_the_bytes_exactly():
    """Quantized afresh (no release at hand), a release whose scales were computed as transformers' Fp8Quantize
    computes them, 1 / (448 / amax) in fp32, not amax / 448: every block's bytes come back, its scale within one
    ulp (here about one in eight differs), since a scale one ulp off moves no value of |q| <= 448 to another
    float8_e4m3fn. With the release at hand its scales are kept (above)."""
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
    q_kept, scale_kept = fp8_source.quantize_fp8_on_source(dequantize_fp8_blocks(q, scale_inv, BLOCK), BLOCK, scale_inv)
    assert np.array_equal(q_kept.view(np.uint8), q.view(np.uint8)) and np.array_equal(scale_kept, scale_inv)


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


@pytest.mark.parametrize("source", ["unquantized", "awq", "other scale_fmt", "config only", "other value"])
def test_quantize_of_a_source_not_fp8_blocks_is_one_line(work, source, tmp_path, capsys):
    """Of FP8, only block-quantized FP8 with fp32 or power-of-two scales is written back; of the rest only pack-quantized INT4
    (test_int4_export.py) and MXFP4 (test_mxfp4_export.py): any other --hf-config original (or one without its weights' headers, or another --quantize
    value) is refused in one line, nothing written."""
    original = tmp_path / "original"
    shutil.copytree(work / "release", original)
    if source == "config only":
        (original / "model.safetensors").unlink()
    config = json.loads((original / "config.json").read_text())
    quantization = {
        "unquantized": None, "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
        "other scale_fmt": {**QUANTIZATION, "scale_fmt": "ue4m3"},
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
                "other scale_fmt": "scale_fmt ue4m3", "config only": "has no model.safetensors.index.json or model.safetensors",
                "other value": "not one of as-source"}[source]
    assert expected in err and ("not supported" in err or source in ("config only", "other value")), err
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("changed", ["one block", "one value of a block's last row", "none"])
def test_only_the_changed_blocks_are_quantized_afresh(changed):
    """Values dequantized from amax / 400 blocks (40 x 70: partial blocks at both edges), one block changed: that
    block is what quantize_fp8_blocks makes of the values, every other keeps its bytes and scale; a change in a
    block's last row alone (its first row, checked first, still exact) too."""
    weight = torch.randn(40, 70) * 0.05
    q, scale = rule_quantize(weight)
    values = dequantize(q, scale).to(torch.bfloat16)
    if changed == "one block":
        values[BLOCK[0] : 2 * BLOCK[0], BLOCK[1] : 2 * BLOCK[1]] *= 1.5
    elif changed != "none":
        values[2 * BLOCK[0] - 1, 5] += 0.01
    ours, ours_scale = fp8_source.quantize_fp8_on_source(dtypes.as_numpy(values), BLOCK, scale.numpy())
    fresh, fresh_scale = quantize_fp8_blocks(dtypes.as_numpy(values), BLOCK)
    block = np.zeros(scale.shape, dtype=bool)
    block[1, 0 if changed.startswith("one value") else 1] = changed != "none"
    assert np.array_equal(ours_scale, np.where(block, fresh_scale, scale.numpy()))
    spread = np.repeat(np.repeat(block, BLOCK[0], 0)[:40], BLOCK[1], 1)[:, :70]
    assert np.array_equal(ours.view(np.uint8), np.where(spread, fresh.view(np.uint8), q.view(torch.uint8).numpy()))


def test_power_of_two_scales_stored_without_ue8m0_in_the_config_are_one_line(work, tmp_path, capsys):
    """float8_e8m0fnu scales under a config without `scale_fmt: ue8m0`: refused in one line naming the tensor."""
    shutil.copytree(work / "release-ue8m0", tmp_path / "original")
    config = json.loads((tmp_path / "original" / "config.json").read_text())
    (tmp_path / "original" / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    args = ["--load-dir", str(work / "mcore"), "--save-dir", str(tmp_path / "out"), "--hf-config", str(tmp_path / "original")]
    assert main(["mcore-to-hf", *args, "--quantize", "as-source"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "with float8_e8m0fnu block scales: only float8_e4m3fn with float32 scales" in err and "_proj.weight'" in err, err
    assert_nothing_left(tmp_path / "out")
