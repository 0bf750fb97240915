"""`mcore-to-hf --quantize as-source` of a compressed-tensors pack-quantized INT4 release (Kimi-K2-Thinking's
quantization_config at the top level, Kimi-K2.5's in its text_config, vision tower beside): the export holds the
release's tensors, names, dtypes and shapes. A group of 32 values that are exactly integers in [-8, 7] times the
release's scale (as the reader gives them, rounded to the scale's dtype, compared in the dtype the export's values
come in) keeps the release's scale and integers: the round trip release -> Megatron (fp32 or bf16) -> release gives
back every byte. Every other group is bit for bit what compressed-tensors' own quantization
(`compute_dynamic_scales_and_zp`, then its PackedQuantizationCompressor) makes of its values in the scales' dtype.
The models are test_int4.py's."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors.torch import load_file

from mconvert.cli import main
from mconvert.converters import quantized_export
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats import quantized
from mconvert.formats.quantized import quantize_int4, unpack_int4
from mconvert.mcore.parallelism import Parallelism
from tests.cli_runner import assert_nothing_left
from tests.test_fp8 import stored
from tests.test_fp8_export import headers, release_from, tensors
from tests.test_int4 import MODELS, QUANTIZATION, made, quantize, with_quantization, write  # noqa: F401 (the module-scoped fixture)

WEIGHTS = QuantizationArgs(**QUANTIZATION["config_groups"]["group_0"]["weights"])


def reference(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """compressed-tensors' packed weight, scales and shape of `weight`, quantized in `dtype` (bf16: a release's)."""
    values = weight.to(dtype)
    scale, zero_point = compute_dynamic_scales_and_zp(values, WEIGHTS, module=None)
    scheme = QuantizationScheme(targets=["Linear"], weights=WEIGHTS)
    return PackedQuantizationCompressor.compress({"weight": values, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)


# Two changes made to the release's values before conversion, as training might make them: one expert's down_proj
# plus 0.01 (every group), and one group of another expert's up_proj times 0.75 (row 3, columns 0 to 31).
SHIFTED, SCALED = "layers.1.mlp.experts.0.down_proj.weight", "layers.1.mlp.experts.1.up_proj.weight"


def prefix(model: str) -> str:
    return "model." if model == "kimi-k2-thinking" else "language_model.model."


def changed(weights: dict[str, torch.Tensor], model: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the weights with SHIFTED and SCALED changed, each changed weight's groups changed: bool [rows, groups])."""
    shifted, scaled = prefix(model) + SHIFTED, prefix(model) + SCALED
    out = dict(weights)
    out[shifted] = weights[shifted] + 0.01
    out[scaled] = weights[scaled].clone()
    out[scaled][3, :32] *= 0.75
    groups = {name: torch.zeros(out[name].shape[0], out[name].shape[1] // 32, dtype=torch.bool) for name in (shifted, scaled)}
    groups[shifted][:] = True
    groups[scaled][3, 0] = True
    return {name: out[name] for name in groups}, groups


@pytest.fixture(scope="module")
def work(made, tmp_path_factory):  # noqa: F811
    """model -> (release, its Megatron conversions in fp32 and bf16, their exports with --quantize as-source: `int4-32`
    and `int4-16` of the fp32 one in fp32 and bf16, `int4-b16` of the bf16 one in bf16; the release's values changed
    (`changed`) in `changed-mcore` (fp32) and its export `changed-int4` (bf16), with the changed weights and groups)."""
    out = {}
    for model in MODELS:
        root = tmp_path_factory.mktemp(model.replace(".", "_") + "-export")
        release, dequantized = made[model]
        for name, dtype in (("32", torch.float32), ("b16", torch.bfloat16)):
            convert_hf_to_mcore(release, root / f"mcore-{name}", parallelism=Parallelism(tp=2, ep=2), dtype=dtype)
        convert_mcore_to_hf(root / "mcore-32", root / "plain", hf_config_dir=release, dtype=torch.bfloat16)
        args = ["mcore-to-hf", "--load-dir", str(root / "mcore-32"), "--save-dir", str(root / "int4-16"), "--hf-config", str(release), "--quantize", "as-source"]
        assert main([*args, "--dtype", "bf16"]) == 0
        for mcore, name, dtype in (("mcore-32", "int4-32", torch.float32), ("mcore-b16", "int4-b16", torch.bfloat16)):
            convert_mcore_to_hf(root / mcore, root / name, hf_config_dir=release, dtype=dtype, quantize="as-source")
        weights = load_file(dequantized / "model.safetensors")
        edited, groups = changed(weights, model)
        release_from({**weights, **edited}, root / "changed", json.loads((dequantized / "config.json").read_text()))
        convert_hf_to_mcore(root / "changed", root / "changed-mcore", parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
        convert_mcore_to_hf(root / "changed-mcore", root / "changed-int4", hf_config_dir=release, dtype=torch.bfloat16, quantize="as-source")
        out[model] = SimpleNamespace(release=release, root=root, edited=edited, groups=groups)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_the_export_has_the_releases_tensors_and_quantization_config(work, model, capsys):
    release, int4, plain = work[model].release, work[model].root / "int4-16", work[model].root / "plain"
    assert headers(int4) == headers(release)
    assert sum(name.endswith(".weight_packed") for name in headers(release)) == 24
    config, original = (json.loads((d / "config.json").read_text()) for d in (int4, release))
    if model == "kimi-k2.5":
        config, original = config["text_config"], original["text_config"]
    assert config["quantization_config"] == original["quantization_config"] == QUANTIZATION
    assert "quantization_config" not in (json.loads((plain / "config.json").read_text()).get("text_config") or {})


@pytest.mark.parametrize("export", ["int4-32", "int4-16", "int4-b16"])
@pytest.mark.parametrize("model", MODELS)
def test_the_round_trip_gives_back_every_byte_of_the_release(work, model, export):
    """Release -> hf-to-mcore (fp32 or bf16: both hold the release's bf16 values exactly) -> mcore-to-hf --quantize
    as-source (fp32 or bf16): every tensor byte for byte, each packed weight's integers and scales included (Kimi-K2.5's
    vision tower too). Quantized afresh, no group would keep its scale: a release's group holds -8 or 7 as its largest
    |q|, and amax / 7.5 is then about 16 / 15 or 14 / 15 of its scale."""
    original, back = tensors(work[model].release), tensors(work[model].root / export)
    assert original.keys() == back.keys()
    assert [name for name, t in original.items() if not torch.equal(back[name], t)] == []
    for name in (n for n in original if n.endswith(".weight_packed")):
        rows, columns = original[name.replace("_packed", "_shape")].tolist()
        assert np.isin(np.abs(unpack_int4(original[name].numpy(), columns).reshape(rows, -1, 32)).max(-1), (7, 8)).all()


def grouped(packed: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    return torch.from_numpy(unpack_int4(packed.numpy(), columns).reshape(rows, -1, 32))


def not_as_expected(export_dir, release_dir, values: dict[str, torch.Tensor], groups: dict[str, torch.Tensor], dtype=torch.bfloat16) -> list[str]:
    """The tensors of an INT4 export that are not the release's but in `groups` (weight name -> bool [rows, groups]),
    where each weight's integers and scales must be compressed-tensors' quantization (in `dtype`) of its `values`."""
    release, back = tensors(release_dir), tensors(export_dir)
    wrong = sorted(release.keys() ^ back.keys())
    for name in sorted(release.keys() & back.keys()):
        module = name.rsplit(".", 1)[0]
        if f"{module}.weight" not in groups:
            if back[name].dtype != release[name].dtype or not torch.equal(back[name], release[name]):
                wrong.append(name)
        elif name.endswith(".weight_packed"):
            weight, mask = values[f"{module}.weight"], groups[f"{module}.weight"]
            rows, columns = weight.shape
            expected = reference(weight, dtype)
            q_want = torch.where(mask[..., None], grouped(expected["weight_packed"], rows, columns), grouped(release[name], rows, columns))
            scale_want = torch.where(mask, expected["weight_scale"], release[f"{module}.weight_scale"])
            scale = back[f"{module}.weight_scale"]
            if not (torch.equal(grouped(back[name], rows, columns), q_want) and torch.equal(scale, scale_want) and scale.dtype == scale_want.dtype):
                wrong.append(name)
    return wrong


@pytest.mark.parametrize("model", MODELS)
def test_changed_groups_are_quantized_afresh_and_only_they(work, model):
    """Megatron weights that are the release's but for one expert's down_proj plus 0.01 and one group of another's
    up_proj times 0.75: those groups are compressed-tensors' quantization of their values, every other group and
    tensor the release's bytes."""
    w = work[model]
    assert not_as_expected(w.root / "changed-int4", w.release, w.edited, w.groups) == []


def always_kept(values, scales, decide=quantized.int4_on_scales):
    integers, exact = decide(values, scales)
    return integers, np.ones_like(exact)


def nibbles_swapped(values, group_size, scale_dtype, source_scales=None):
    packed, scales = quantize_int4(values, group_size, scale_dtype, source_scales)
    nibbles = packed.view(np.uint8)
    return ((nibbles & 0x0F) << 4 | nibbles >> 4).view(np.int32), scales


def scale_per_row(values, group_size, scale_dtype, source_scales=None):
    packed, scales = quantize_int4(values, None, scale_dtype)
    return packed, np.repeat(scales, values.shape[1] // group_size, 1)


@pytest.mark.parametrize("fault", ["release's scale for every group", "nibbles swapped", "one scale a row"])
def test_a_wrong_quantizer_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: keeping the release's scale for every group, the changed ones too (their integers rounded on
    it), fails the check on the two changed weights; each byte's two integers in the other order, or one scale for
    a whole row, fails it on every packed weight."""
    w = work["kimi-k2-thinking"]
    if fault == "release's scale for every group":
        monkeypatch.setattr(quantized, "int4_on_scales", always_kept)
    else:
        monkeypatch.setattr(quantized_export, "quantize_int4", nibbles_swapped if fault == "nibbles swapped" else scale_per_row)
    convert_mcore_to_hf(w.root / "changed-mcore", tmp_path / "int4", hf_config_dir=w.release, dtype=torch.bfloat16, quantize="as-source")
    wrong = not_as_expected(tmp_path / "int4", w.release, w.edited, w.groups)
    if fault == "release's scale for every group":
        assert wrong == sorted(f"model.{name}_packed" for name in (SHIFTED, SCALED))
    else:
        assert len([name for name in wrong if name.endswith("_packed")]) == 24


def test_fp32_scales_through_bf16_fall_back_where_bf16_rounds(made, tmp_path):  # noqa: F811
    """A release with fp32 scales (compressed-tensors on fp32 weights) through a bf16 Megatron checkpoint. Exported in
    bf16, every group is kept: its values are bf16(q x s), which the release gives in bf16. Exported in fp32, a group is
    kept exactly where every q x s (fp32) is a bf16 value; any other group's values are no longer q x s in fp32, and
    it is quantized afresh, compressed-tensors' quantization in fp32 of the values bf16 left."""
    _, dequantized = made["kimi-k2-thinking"]
    weights = {name: t.float() for name, t in load_file(dequantized / "model.safetensors").items()}
    config = with_quantization(json.loads((dequantized / "config.json").read_text()), QUANTIZATION)
    release = write(tmp_path / "release", quantize(weights), {**config, "torch_dtype": "float32"})
    convert_hf_to_mcore(release, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2), dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        convert_mcore_to_hf(tmp_path / "mcore", tmp_path / str(dtype), hf_config_dir=release, dtype=dtype, quantize="as-source")
    stored = tensors(release)
    values, groups = {}, {}
    for name in (n for n in stored if n.endswith(".weight_packed")):
        module = name.removesuffix(".weight_packed")
        rows, columns = stored[f"{module}.weight_shape"].tolist()
        scales = stored[f"{module}.weight_scale"]
        assert scales.dtype == torch.float32
        products = grouped(stored[name], rows, columns) * scales[..., None]
        values[f"{module}.weight"] = products.bfloat16().float().reshape(rows, columns)
        groups[f"{module}.weight"] = (products.bfloat16().float() != products).any(-1)
    fallen = torch.cat([mask.flatten() for mask in groups.values()]).float().mean()
    assert 0.5 < fallen < 1  # most groups fall back, some are kept
    only_packed = {name: (dtype, shape) for name, (dtype, shape) in headers(release).items() if "weight_" in name}
    for export in (tmp_path / str(torch.bfloat16), tmp_path / str(torch.float32)):
        assert {name: h for name, h in headers(export).items() if name in only_packed} == only_packed
    kept_all = {name: torch.zeros_like(mask) for name, mask in groups.items()}
    assert [name for name in not_as_expected(tmp_path / str(torch.bfloat16), release, values, kept_all) if name in only_packed] == []
    assert [name for name in not_as_expected(tmp_path / str(torch.float32), release, values, groups, torch.float32) if name in only_packed] == []


@pytest.mark.parametrize("model", MODELS)
def test_the_int4_export_converts_as_its_dequantized_values(work, model, tmp_path):
    """The export is a valid input: hf-to-mcore of the changed export reads each packed weight as its integers times
    its scales, the values quantize_int4's inverse gives (hf_checkpoint's dequantize_int4, checked against
    compressed-tensors in test_int4.py), in bf16 exactly as the Megatron checkpoint holds them in fp32."""
    int4 = work[model].root / "changed-int4"
    convert_hf_to_mcore(int4, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
    read = stored(tmp_path / "mcore")
    experts = read["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]
    back = tensors(int4)
    module = prefix(model) + SHIFTED.removesuffix(".weight")
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
    "tensor strategy": (dict(strategy="tensor", group_size=None), "config_groups.group_0 weights of strategy tensor"),
    "8 bits": (dict(num_bits=8), "config_groups.group_0 weights of type int, num_bits 8"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_int4_scheme_not_written_back_is_one_line(work, case, tmp_path, capsys):
    release, mcore = work["kimi-k2-thinking"].release, work["kimi-k2-thinking"].root / "mcore-32"
    weights, expected = REFUSED[case]
    original = with_scheme(release, tmp_path / "original", **weights)
    code = main(["mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(tmp_path / "out"), "--hf-config", str(original), "--quantize", "as-source"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("mconvert: error:") and expected in err, err
    assert_nothing_left(tmp_path / "out")
