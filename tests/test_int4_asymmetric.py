"""Asymmetric compressed-tensors pack-quantized INT4 (`symmetric: false`: a `weight_zero_point` per group, packed
down the rows) both ways, held to compressed-tensors 0.20 itself: a shrunk Kimi-K2-Thinking whose routed experts
its compressor quantizes so (`calculate_qparams` of each group's min and max, `PackedQuantizationCompressor`)
converts to Megatron as its own `CompressedTensorsDequantizer` dequantizes it; exported with --quantize as-source
it comes back byte for byte (each group exact on the release's scale and zero point keeps them); and the bf16
model it was made from, exported with the release as --hf-config (no group of it exact on those), is quantized
to the release's very bytes, which compressed-tensors made of the same values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file

from mconvert import dtypes
from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats import int4_asymmetric
from mconvert.formats.int4_asymmetric import quantize_int4_asymmetric
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left
from tests.test_fp8 import stored
from tests.test_fp8_export import headers, tensors
from tests.test_int4 import QUANTIZATION, with_quantization, write

GROUP = QUANTIZATION["config_groups"]["group_0"]
ASYMMETRIC = {**QUANTIZATION, "config_groups": {"group_0": {**GROUP, "weights": {**GROUP["weights"], "symmetric": False}}}}
WEIGHTS = QuantizationArgs(**ASYMMETRIC["config_groups"]["group_0"]["weights"])
SCHEME = QuantizationScheme(targets=["Linear"], weights=WEIGHTS)


def reference(weight: torch.Tensor, args: QuantizationArgs = WEIGHTS) -> dict[str, torch.Tensor]:
    """compressed-tensors' packed weight, scales, shape and packed zero points of a bf16 `weight`."""
    size = args.group_size or weight.shape[-1]
    grouped = weight.unflatten(-1, (weight.shape[-1] // size, size))
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


def quantize(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kimi's INT4 layout (test_int4.quantize's), with asymmetric groups."""
    out = {}
    for name, tensor in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or any(match_name(module, pattern) for pattern in ASYMMETRIC["ignore"]):
            out[name] = tensor
        else:
            out.update({f"{module}.{key}": value for key, value in reference(tensor).items()})
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The bf16 model (`source`), its asymmetric INT4 release, compressed-tensors' dequantization of that; the
    release and its dequantization in Megatron (fp32), the release exported as itself in fp32 and bf16 (`back-32`,
    `back-16`), and the source converted to Megatron and exported with the release as --hf-config (`fresh`)."""
    root = tmp_path_factory.mktemp("int4-asymmetric")
    config = {**real_config("kimi-k2-instruct"), "quantization_config": ASYMMETRIC}
    source = make_hf_checkpoint(shrink(config, moe_intermediate_size=96), root / "source", dtype="bfloat16", weight_std=0.1)
    plain = json.loads((source / "config.json").read_text())
    release = write(root / "release", quantize(load_file(source / "model.safetensors")), with_quantization(plain, ASYMMETRIC))
    dequantized = CompressedTensorsDequantizer(release, dtype=torch.bfloat16).validate(load_file(release / "model.safetensors"))
    write(root / "dequantized", dequantized, with_quantization(plain, None))
    for name in ("release", "dequantized", "source"):
        convert_hf_to_mcore(root / name, root / f"mcore-{name}", parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
    for mcore, out, dtype in (("mcore-release", "back-32", torch.float32), ("mcore-release", "back-16", torch.bfloat16), ("mcore-source", "fresh", torch.bfloat16)):
        convert_mcore_to_hf(root / mcore, root / out, hf_config_dir=release, dtype=dtype, quantize="as-source")
    return root


def test_the_release_converts_as_compressed_tensors_dequantizes_it(work):
    assert sum(name.endswith(".weight_zero_point") for name in headers(work / "release")) == 24
    from_int4, from_plain = stored(work / "mcore-release"), stored(work / "mcore-dequantized")
    assert sorted(from_int4) == sorted(from_plain)
    assert [key for key in from_plain if not torch.equal(from_int4[key], from_plain[key])] == []


@pytest.mark.parametrize("export", ["back-32", "back-16", "fresh"])
def test_the_export_is_the_release_byte_for_byte(work, export):
    """`back-*`: the round trip keeps every group's scale, zero point and integers. `fresh`: every group quantized
    afresh from the values compressed-tensors quantized, giving what it gave. Unquantized tensors: the release's
    values (in fp32 in `back-32`)."""
    ours, theirs = headers(work / export), headers(work / "release")
    assert ours.keys() == theirs.keys() and [name for name in ours if ours[name] != theirs[name] and (export != "back-32" or ".weight_" in name)] == []
    assert json.loads((work / export / "config.json").read_text())["quantization_config"] == ASYMMETRIC
    original, back = tensors(work / "release"), tensors(work / export)
    assert [name for name, t in original.items() if not torch.equal(back[name], t)] == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group_size", [32, None])
def test_quantize_int4_asymmetric_is_compressed_tensors_bit_for_bit(dtype, group_size):
    """Groups of 32 and one a row (strategy channel), scales in bf16, fp16 or fp32; groups of zeros (0 / 0 zero
    points, which torch casts to 0), of positive or negative values only (min or max clamped to 0), and shifted
    ones (a zero point at the end of the range)."""
    args = QuantizationArgs(**{**WEIGHTS.model_dump(), "strategy": "group" if group_size else "channel", "group_size": group_size})
    weight = torch.randn(37, 96) * 0.05
    weight[0, :32], weight[1, :32], weight[2, :32] = 0, weight[1, :32].abs(), -weight[2, :32].abs()
    weight[3] += 0.3
    weight[5] = 0 if group_size is None else weight[5]
    theirs = reference(weight.to(dtype), args)
    scale_dtype = {torch.bfloat16: dtypes.bfloat16, torch.float16: dtypes.float16, torch.float32: dtypes.float32}[dtype]
    packed, scales, zeros = quantize_int4_asymmetric(weight.numpy(), group_size, scale_dtype)
    assert np.array_equal(packed, theirs["weight_packed"].numpy()) and np.array_equal(zeros, theirs["weight_zero_point"].numpy())
    assert torch.equal(dtypes.as_torch(scales), theirs["weight_scale"])


@pytest.mark.parametrize("fault", ["no group kept", "zero points' nibbles swapped", "zero points not offset"])
def test_a_wrong_asymmetric_quantizer_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: quantizing every group afresh loses the round trip's bytes (a group's range from its
    dequantized values is not the one it was quantized from); packing the zero points with each byte's two
    integers swapped, or without compressed-tensors' offset of 8, gives other bytes than its packing."""
    right_rows, right_pack = int4_asymmetric._asymmetric_rows, int4_asymmetric.pack_int4
    if fault == "no group kept":
        monkeypatch.setattr(int4_asymmetric, "_asymmetric_rows", lambda values, size, dtype, source: right_rows(values, size, dtype, None))
    else:
        calls = []

        def wrong(nibbles):  # each weight's second call packs its zero points
            calls.append(None)
            if len(calls) % 2:
                return right_pack(nibbles)
            if fault == "zero points not offset":
                return right_pack(nibbles - 8)
            return right_pack(np.ascontiguousarray(nibbles.reshape(nibbles.shape[0], -1, 2)[..., ::-1].reshape(nibbles.shape)))

        monkeypatch.setattr(int4_asymmetric, "pack_int4", wrong)
    convert_mcore_to_hf(work / "mcore-release", tmp_path / "out", hf_config_dir=work / "release", dtype=torch.float32, quantize="as-source")
    original, back = tensors(work / "release"), tensors(tmp_path / "out")
    changed = {name.rsplit(".", 1)[1] for name, t in original.items() if not torch.equal(back[name], t)}
    assert changed >= ({"weight_packed", "weight_scale"} if fault == "no group kept" else {"weight_zero_point"}), changed
    if fault == "no group kept":  # and `fresh` owes nothing to kept groups: quantized afresh, it is the same
        convert_mcore_to_hf(work / "mcore-source", tmp_path / "fresh", hf_config_dir=work / "release", dtype=torch.bfloat16, quantize="as-source")
        assert all(torch.equal(t, original[name]) for name, t in tensors(tmp_path / "fresh").items())


def test_an_original_without_its_zero_points_is_one_line(work, tmp_path, capsys):
    """An asymmetric original one of whose packed weights lacks its weight_zero_point: refused in one line naming
    the tensor, nothing written."""
    original = tensors(work / "release")
    module = next(name for name in original if name.endswith(".weight_zero_point")).removesuffix(".weight_zero_point")
    del original[f"{module}.weight_zero_point"]
    write(tmp_path / "original", original, json.loads((work / "release" / "config.json").read_text()))
    args = ["--load-dir", str(work / "mcore-release"), "--save-dir", str(tmp_path / "out"), "--hf-config", str(tmp_path / "original")]
    code = main(["mcore-to-hf", *args, "--quantize", "as-source"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and f"'{module}.weight_packed'" in err and f"a {module}.weight_zero_point of" in err, err
    assert_nothing_left(tmp_path / "out")


def test_the_summary_names_the_zero_points(work, tmp_path, capsys):
    args = ["--load-dir", str(work / "mcore-release"), "--save-dir", str(tmp_path / "out"), "--hf-config", str(work / "release")]
    assert main(["mcore-to-hf", *args, "--quantize", "as-source"]) == 0
    assert "pack-quantized in INT4 with their weight_scale, weight_shape and weight_zero_point" in capsys.readouterr().out
