"""`mcore-to-hf --quantize as-source` of a compressed-tensors pack-quantized INT4 release (Kimi-K2-Thinking's
quantization_config at the top level, Kimi-K2.5's in its text_config, vision tower beside): the export holds the
release's tensors, names, dtypes and shapes, each packed weight bit for bit what compressed-tensors' own quantization
(`compute_dynamic_scales_and_zp`, then its PackedQuantizationCompressor) makes of the unquantized export's weight in
bf16, the scales' dtype. The models are test_int4.py's; the release -> Megatron (fp32) -> release round trip gives
back the unpacked tensors and weight shapes, never the scales (see the test of it)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from mconvert.cli import main
from mconvert.converters import quantized_export
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats.quantized import quantize_int4, unpack_int4
from mconvert.mcore.parallelism import Parallelism
from tests.cli_runner import assert_nothing_left
from tests.test_fp8 import stored
from tests.test_fp8_export import headers, tensors
from tests.test_int4 import MODELS, QUANTIZATION, made  # noqa: F401 (the module-scoped fixture)

WEIGHTS = QuantizationArgs(**QUANTIZATION["config_groups"]["group_0"]["weights"])


def reference(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' packed weight, scales and shape of `weight`, quantized in bf16 as a release's are."""
    values = weight.to(torch.bfloat16)
    scale, zero_point = compute_dynamic_scales_and_zp(values, WEIGHTS, module=None)
    scheme = QuantizationScheme(targets=["Linear"], weights=WEIGHTS)
    return PackedQuantizationCompressor.compress({"weight": values, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


@pytest.fixture(scope="module")
def work(made, tmp_path_factory):  # noqa: F811
    """model -> (release, its Megatron conversion in fp32, the unquantized export and the INT4 one, in bf16: the
    release's dtype, which the fp32 checkpoint holds exactly)."""
    out = {}
    for model in MODELS:
        root = tmp_path_factory.mktemp(model.replace(".", "_") + "-export")
        release = made[model][0]
        convert_hf_to_mcore(release, root / "mcore", parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
        convert_mcore_to_hf(root / "mcore", root / "plain", hf_config_dir=release, dtype=torch.bfloat16)
        args = ["mcore-to-hf", "--load-dir", str(root / "mcore"), "--save-dir", str(root / "int4"), "--hf-config", str(release), "--quantize", "as-source"]
        args += ["--dtype", "bf16"]
        assert main(args) == 0
        out[model] = release, root / "mcore", root / "plain", root / "int4"
    return out


def mismatches(int4_dir, plain_dir) -> list[str]:
    """The tensors of an INT4 export that are not compressed-tensors' packing of the unquantized export's weight or,
    unquantized, not that tensor."""
    int4, plain = tensors(int4_dir), tensors(plain_dir)
    wrong = []
    for name, tensor in plain.items():
        module = name.removesuffix(".weight")
        if f"{module}.weight_packed" in int4:
            expected = reference(tensor)
            if any(not torch.equal(int4[f"{module}.{key}"], value) for key, value in expected.items()):
                wrong.append(name)
        elif not torch.equal(int4[name], tensor):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("model", MODELS)
def test_the_export_has_the_releases_tensors_and_quantization_config(work, model, capsys):
    release, _, plain, int4 = work[model]
    assert headers(int4) == headers(release)
    assert sum(name.endswith(".weight_packed") for name in headers(release)) == 24
    config, original = (json.loads((d / "config.json").read_text()) for d in (int4, release))
    if model == "kimi-k2.5":
        config, original = config["text_config"], original["text_config"]
    assert config["quantization_config"] == original["quantization_config"] == QUANTIZATION
    assert "quantization_config" not in (json.loads((plain / "config.json").read_text()).get("text_config") or {})


@pytest.mark.parametrize("model", MODELS)
def test_each_packed_weight_is_compressed_tensors_output_bit_for_bit(work, model):
    """Everything else, Kimi-K2.5's vision tower included, is the unquantized export's tensor."""
    _, _, plain, int4 = work[model]
    assert mismatches(int4, plain) == []


def nibbles_swapped(values, group_size, scale_dtype):
    packed, scales = quantize_int4(values, group_size, scale_dtype)
    nibbles = packed.view(np.uint8)
    return ((nibbles & 0x0F) << 4 | nibbles >> 4).view(np.int32), scales


def scale_per_row(values, group_size, scale_dtype):
    return quantize_int4(values, None, scale_dtype)[0], np.repeat(quantize_int4(values, None, scale_dtype)[1], values.shape[1] // group_size, 1)


@pytest.mark.parametrize("fault", [nibbles_swapped, scale_per_row])
def test_a_wrong_quantizer_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: each byte's two integers in the other order, or one scale for a whole row, fails the check
    on every packed weight."""
    release, mcore, plain, _ = work["kimi-k2-thinking"]
    monkeypatch.setattr(quantized_export, "quantize_int4", fault)
    convert_mcore_to_hf(mcore, tmp_path / "int4", hf_config_dir=release, dtype=torch.bfloat16, quantize="as-source")
    assert len(mismatches(tmp_path / "int4", plain)) == 24


@pytest.mark.parametrize("model", MODELS)
def test_the_round_trip_gives_back_the_unpacked_tensors_and_shapes_never_the_scales(work, model):
    """Release -> hf-to-mcore (fp32, which holds the bf16 values exactly) -> mcore-to-hf --quantize as-source. The
    bytes that come back: every tensor not packed (Kimi-K2.5's vision tower too) and each weight_shape. A packed
    weight's scales never do: compressed-tensors' scale is a group's amax / 7.5, so a release's group holds -8 or 7
    as its largest |q|, and its values quantized again get the scale 8 s / 7.5 (about 16 / 15 of the release's) or
    7 s / 7.5 (about 14 / 15); each integer comes back within one, and most groups' integers exactly (bf16's
    roundings move some). So an INT4 release is not reproduced bit for bit, only requantized as compressed-tensors
    would quantize its values."""
    release, _, _, int4 = work[model]
    original, back = tensors(release), tensors(int4)
    assert original.keys() == back.keys()
    assert all(torch.equal(back[name], t) for name, t in original.items() if not name.endswith((".weight_packed", ".weight_scale")))
    for name in (n for n in original if n.endswith(".weight_packed")):
        module = name.removesuffix(".weight_packed")
        rows, columns = original[f"{module}.weight_shape"].tolist()
        q = unpack_int4(original[name].numpy(), columns).reshape(rows, -1, 32)
        q_back = unpack_int4(back[name].numpy(), columns).reshape(rows, -1, 32)
        assert np.isin(np.abs(q).max(-1), (7, 8)).all() and np.abs(q_back - q).max() == 1
        ratio = (back[f"{module}.weight_scale"].float() / original[f"{module}.weight_scale"].float()).numpy()
        minus_8 = q.min(-1) == -8
        assert ((1.05 < ratio) & (ratio < 1.08))[minus_8].all() and ((0.92 < ratio) & (ratio < 0.945))[~minus_8].all()
        assert 0.5 < (q_back == q).all(-1).mean() < 1


@pytest.mark.parametrize("model", MODELS)
def test_the_int4_export_converts_as_its_dequantized_values(work, model, tmp_path):
    """The export is a valid input: hf-to-mcore of it reads each packed weight as its integers times its scales,
    the values quantize_int4's inverse gives (hf_checkpoint's dequantize_int4, checked against compressed-tensors in
    test_int4.py), in bf16 exactly as the Megatron checkpoint holds them in fp32."""
    _, _, plain, int4 = work[model]
    convert_hf_to_mcore(int4, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
    read = stored(tmp_path / "mcore")
    experts = read["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]
    back = tensors(int4)
    module = "model.layers.1.mlp.experts.0.down_proj" if model == "kimi-k2-thinking" else "language_model.model.layers.1.mlp.experts.0.down_proj"
    q = torch.from_numpy(unpack_int4(back[f"{module}.weight_packed"].numpy(), 96).reshape(-1, 3, 32))
    values = (q * back[f"{module}.weight_scale"].float()[..., None]).to(torch.bfloat16).float().reshape(-1, 96)
    assert experts.dtype == torch.float32 and any(torch.equal(values, part) for part in experts.reshape(-1, *values.shape))


def with_scheme(release, directory, **weights):
    shutil.copytree(release, directory)
    config = json.loads((directory / "config.json").read_text())
    scheme = {**QUANTIZATION, "config_groups": {"group_0": {**QUANTIZATION["config_groups"]["group_0"], "weights": {**WEIGHTS.model_dump(mode="json"), **weights}}}}
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": scheme}))
    return directory


REFUSED = {
    "asymmetric": (dict(symmetric=False), "is asymmetric pack-quantized INT4 (zero points): not supported yet"),
    "8 bits": (dict(num_bits=8), "config_groups.group_0 weights of type int, num_bits 8"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_int4_scheme_not_written_back_is_one_line(work, case, tmp_path, capsys):
    release, mcore, _, _ = work["kimi-k2-thinking"]
    weights, expected = REFUSED[case]
    original = with_scheme(release, tmp_path / "original", **weights)
    code = main(["mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(tmp_path / "out"), "--hf-config", str(original), "--quantize", "as-source"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("mconvert: error:") and expected in err, err
    assert_nothing_left(tmp_path / "out")
