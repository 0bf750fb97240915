"""`mcore-to-hf --quantize as-source` of gpt-oss's MXFP4 release: the experts' gate_up_proj and down_proj written as
`_blocks` and `_scales` again. A group of 32 values that are exactly e2m1 values times the release's scale (compared in
the dtype the export's values come in) keeps the release's scale and codes: the round trip release -> Megatron (bf16
or fp32) -> release gives back every byte. Every other group is held bit for bit to a reference quantizer.

The reference is torchao's OCP MX quantization with the scale rounded up (tests/mx_reference.py): amax / 6 rounded up
to a power of two, each value rounded to the nearest e2m1 (ties to even), two a byte, the first in the low 4 bits.
That is the arithmetic of triton_kernels' `downcast_to_mxfp` and of its torch twin `downcast_to_mxfp_torch` with their
default rounding (ROUND_UP), which gpt-oss's reference (`quantize_mx4`) and transformers (`quantize_to_mxfp4`) call on
the experts cast to bf16. triton_kernels is no package of the index (it comes with the triton repository, and
transformers fetches it from the hub): tests/gpu/test_mxfp4_quantizer.py holds the quantizer to it where it is
installed. The OCP spec's own scale, 2^(floor(log2(amax)) - 2), is the same where a group's largest value quantizes to
4 or 6; where it would quantize to 3, the OCP scale is half, and it clips values past 6 times its scale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from mconvert.cli import main
from mconvert.converters import quantized_export
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats import quantized
from mconvert.formats.quantized import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left
from tests.test_fp8_export import headers, release_from, tensors

QUANTIZATION = real_config("gpt-oss-20b")["quantization_config"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
QUANTIZED = [f"model.layers.{layer}.{name}" for layer in (0, 1) for name in EXPERTS]
LAYOUT = Parallelism(tp=2, ep=2, etp=1)
# torchao, where scripts/install.sh puts it: beside the environment's packages, not among them.
TORCHAO = Path(sys.prefix) / "mx-reference"
# Each code's magnitude, by its 4 bits.
MAGNITUDES = torch.tensor(FP4_VALUES).abs()


def reference(weights: dict[str, torch.Tensor], work: Path) -> dict[str, torch.Tensor]:
    """The reference quantizer's `X_blocks` and `X_scales` of each expert tensor `X` of `weights`, from its process."""
    assert (TORCHAO / "torchao").is_dir(), f"no torchao in {TORCHAO}: run scripts/install.sh"
    save_file(weights, work / "weights.safetensors")
    env = {**os.environ, "PYTHONPATH": str(TORCHAO)}
    script = Path(__file__).with_name("mx_reference.py")
    done = subprocess.run([sys.executable, script, work / "weights.safetensors", work / "mxfp4.safetensors"], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return load_file(work / "mxfp4.safetensors")


def export(mcore, out, release, **options) -> None:
    convert_mcore_to_hf(mcore, out, hf_config_dir=release, quantize="as-source", **options)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A shrunk gpt-oss release (weights at about 0.1, one group of zeros; the experts quantized by the reference, the
    rest in bf16), its Megatron conversion (bf16, TP 2 x EP 2) and exports, unquantized (`plain`) and with --quantize
    as-source (`mxfp4`); and `trained`: Megatron weights that are no MXFP4 values (the weights the release was made
    from, in fp32), with their exports in fp32. `reference`: the reference quantizer's output for those weights.
    `mcore-32`: the release in fp32, exported in bf16 (`mxfp4-32`) and fp32 (`mxfp4-f32`). `changed-mcore`: the release's values changed (see
    `changed`), exported with --quantize as-source (`changed-mxfp4`); `edited` the changed weights, `groups` their
    changed groups (bool [experts, outputs, groups]), `changed_reference` the reference quantizer's output for them."""
    root = tmp_path_factory.mktemp("mxfp4-export")
    config = {**shrink(real_config("gpt-oss-20b"), layers=2), "torch_dtype": "bfloat16"}
    source = make_hf_checkpoint(config, root / "source")
    weights = {name: tensor * 2 for name, tensor in load_file(source / "model.safetensors").items()}
    weights["model.layers.1.mlp.experts.down_proj"][3, :32, 5] = 0  # the first group of expert 3's output 5
    release_from(weights, root / "trained-hf", config)
    expected = reference({name: weights[name] for name in QUANTIZED}, root)
    release = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items() if name not in QUANTIZED}
    release_from({**release, **expected}, root / "release", {**config, "quantization_config": QUANTIZATION})
    convert_hf_to_mcore(root / "release", root / "mcore", parallelism=LAYOUT)
    convert_mcore_to_hf(root / "mcore", root / "plain", hf_config_dir=root / "release")
    args = ["mcore-to-hf", "--load-dir", str(root / "mcore"), "--save-dir", str(root / "mxfp4"), "--hf-config", str(root / "release")]
    assert main([*args, "--quantize", "as-source"]) == 0
    convert_hf_to_mcore(root / "trained-hf", root / "trained", parallelism=LAYOUT, dtype=torch.float32)
    convert_mcore_to_hf(root / "trained", root / "trained-plain", hf_config_dir=root / "release", dtype=torch.float32)
    export(root / "trained", root / "trained-mxfp4", root / "release", dtype=torch.float32)
    convert_hf_to_mcore(root / "release", root / "mcore-32", parallelism=LAYOUT, dtype=torch.float32)
    export(root / "mcore-32", root / "mxfp4-32", root / "release", dtype=torch.bfloat16)
    export(root / "mcore-32", root / "mxfp4-f32", root / "release", dtype=torch.float32)
    plain = tensors(root / "plain")
    edited, groups = changed(plain, tensors(root / "release"))
    release_from({**plain, **edited}, root / "changed-hf", json.loads((root / "plain" / "config.json").read_text()))
    convert_hf_to_mcore(root / "changed-hf", root / "changed-mcore", parallelism=LAYOUT)
    export(root / "changed-mcore", root / "changed-mxfp4", root / "release")
    (root / "changed-reference").mkdir()
    changed_reference = reference(edited, root / "changed-reference")
    return SimpleNamespace(root=root, weights=weights, reference=expected, edited=edited, groups=groups, changed_reference=changed_reference)


SHIFTED, SCALED = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"


def changed(plain: dict[str, torch.Tensor], release: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two changes to the release's values, as training might make them: (SHIFTED with expert 2 plus 0.01, SCALED with
    one group times 0.75: expert 1's first output whose second group's largest code is 4, so that its values quantized
    afresh get half the release's scale), and each one's changed groups."""
    edited = {name: plain[name].clone() for name in (SHIFTED, SCALED)}
    edited[SHIFTED][2] += 0.01
    output = int(torch.nonzero(groups(release[SCALED + "_blocks"])[1, :, 1] == 4)[0])
    edited[SCALED][1, 32:64, output] *= 0.75
    masks = {name: torch.zeros(release[name + "_scales"].shape, dtype=torch.bool) for name in edited}
    masks[SHIFTED][2] = True
    masks[SCALED][1, output, 1] = True
    return edited, masks


def test_the_export_has_the_releases_tensors_and_quantization_config(work):
    root = work.root
    assert headers(root / "mxfp4") == headers(root / "release")
    assert sorted(name.removesuffix("_blocks") for name in headers(root / "release") if name.endswith("_blocks")) == sorted(QUANTIZED)
    assert json.loads((root / "mxfp4" / "config.json").read_text())["quantization_config"] == QUANTIZATION
    assert "quantization_config" not in json.loads((root / "plain" / "config.json").read_text())


def mismatches(mxfp4_dir, plain_dir, expected) -> list[str]:
    """The tensors of an MXFP4 export that are not the `expected` blocks and scales, or, unquantized, not the
    unquantized export's tensor."""
    mxfp4, plain = tensors(mxfp4_dir), tensors(plain_dir)
    wrong = sorted(set(plain) ^ {name.removesuffix("_blocks") for name in mxfp4 if not name.endswith("_scales")})
    for name, tensor in plain.items():
        if name + "_blocks" in mxfp4:
            if not all(torch.equal(mxfp4[name + part], expected[name + part]) for part in ("_blocks", "_scales")):
                wrong.append(name)
        elif name in mxfp4 and not torch.equal(mxfp4[name], tensor):
            wrong.append(name)
    return wrong


def test_each_mxfp4_tensor_is_the_reference_quantizers_output_bit_for_bit(work):
    """Of weights that are no MXFP4 values (fp32, cast to bf16 first as the reference's callers do): every byte of
    blocks and scales, a group of zeros with exponent 0 too; the other tensors are the unquantized export's."""
    plain = tensors(work.root / "trained-plain")
    assert all(torch.equal(plain[name], work.weights[name]) for name in QUANTIZED)  # what the reference was given
    assert mismatches(work.root / "trained-mxfp4", work.root / "trained-plain", work.reference) == []
    assert work.reference["model.layers.1.mlp.experts.down_proj_scales"][3, 5, 0] == 0


def groups(blocks: torch.Tensor) -> torch.Tensor:
    """Each group's largest magnitude, in its codes."""
    return torch.maximum(MAGNITUDES[(blocks & 0x0F).long()], MAGNITUDES[(blocks >> 4).long()]).amax(-1)


def not_as_expected(export_dir, release_dir, expected: dict[str, torch.Tensor] | None = None, changed: dict[str, torch.Tensor] | None = None) -> list[str]:
    """The tensors of an MXFP4 export that are not the release's byte for byte but in the `changed` groups (by
    expert tensor, bool [experts, outputs, groups]), whose blocks and scales must be the `expected` ones."""
    release, back, changed = tensors(release_dir), tensors(export_dir), changed or {}
    wrong = sorted(release.keys() ^ back.keys())
    for name in sorted(release.keys() & back.keys()):
        tensor = name.removesuffix("_blocks")
        if tensor in changed:
            mask = changed[tensor]
            blocks = torch.where(mask[..., None], expected[tensor + "_blocks"], release[name])
            scales = torch.where(mask, expected[tensor + "_scales"], release[tensor + "_scales"])
            if not (torch.equal(back[name], blocks) and torch.equal(back[tensor + "_scales"], scales)):
                wrong.append(tensor)
        elif name.removesuffix("_scales") not in changed and (back[name].dtype != release[name].dtype or not torch.equal(back[name], release[name])):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("export", ["mxfp4", "mxfp4-32", "mxfp4-f32"])
def test_the_round_trip_gives_back_every_byte_of_the_release(work, export):
    """Release -> hf-to-mcore (bf16 or fp32, which hold MXFP4 values exactly: a 4-bit float times a power of two) ->
    mcore-to-hf --quantize as-source (bf16; or fp32, whose unquantized tensors are then fp32): every tensor byte for
    byte. About log2(3.5 / 3), 22 %, of the
    reference's groups of normal weights have 3 as their largest code (amax / scale in (3, 3.5)): their values are
    also those of codes twice as large at half the scale, which any quantizer given the values alone finds; they
    come back as the release stored them because the release's own scale is kept."""
    release = tensors(work.root / "release")
    for name in (n for n in release if n.endswith("_blocks")):
        blocks, scales = release[name], release[name.replace("_blocks", "_scales")]
        assert torch.equal(convert_moe_packed_tensors(blocks, scales).float(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        assert 0.1 < (groups(blocks) == 3).float().mean() < 0.4
    zeros = release["model.layers.1.mlp.experts.down_proj_blocks"][3, 5, 0]
    assert not zeros.any() and release["model.layers.1.mlp.experts.down_proj_scales"][3, 5, 0] == 0
    wrong = not_as_expected(work.root / export, work.root / "release")
    assert [name for name in wrong if export != "mxfp4-f32" or name.endswith(("_blocks", "_scales"))] == []


def test_changed_groups_are_quantized_afresh_and_only_they(work):
    """Megatron weights that are the release's but for one expert of a tensor plus 0.01 and one group of another's
    times 0.75: those groups are the reference quantizer's output for their values, every other group and tensor
    the release's bytes."""
    assert not_as_expected(work.root / "changed-mxfp4", work.root / "release", work.changed_reference, work.groups) == []


def nibbles_swapped(values, source=None):
    blocks, scales = quantize_mxfp4(values, source)
    return (blocks & 0x0F) << 4 | blocks >> 4, scales


def scales_off_by_one(values, source=None):
    blocks, scales = quantize_mxfp4(values, source)
    return blocks, scales + 1


FAULTS = {"nibbles swapped": nibbles_swapped, "scales off by one": scales_off_by_one}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_wrong_quantizer_is_caught(work, fault, tmp_path, monkeypatch):
    """Fault injection: each byte's two codes in the other order, or each exponent one too large, fails the
    reference check and the round trip's on every quantized tensor."""
    root = work.root
    monkeypatch.setattr(quantized_export, "quantize_mxfp4", FAULTS[fault])
    export(root / "trained", tmp_path / "trained", root / "release", dtype=torch.float32)
    assert sorted(mismatches(tmp_path / "trained", root / "trained-plain", work.reference)) == sorted(QUANTIZED)
    export(root / "mcore", tmp_path / "back", root / "release")
    part = "_blocks" if fault == "nibbles swapped" else "_scales"
    assert not_as_expected(tmp_path / "back", root / "release") == sorted(name + part for name in QUANTIZED)


def always_kept(values, exponents, decide=quantized.mxfp4_on_scales):
    codes, exact = decide(values, exponents)
    return codes, np.ones_like(exact)


def test_keeping_the_releases_scale_for_changed_groups_is_caught(work, tmp_path, monkeypatch):
    """Fault injection: keeping the release's scale for every group, the changed ones too (their codes rounded on
    it), fails the check on both changed tensors."""
    monkeypatch.setattr(quantized, "mxfp4_on_scales", always_kept)
    export(work.root / "changed-mcore", tmp_path / "out", work.root / "release")
    assert not_as_expected(tmp_path / "out", work.root / "release", work.changed_reference, work.groups) == sorted((SHIFTED, SCALED))


def test_an_original_not_matching_the_export_is_one_line(work, tmp_path, capsys):
    """An MXFP4 original whose experts are of another shape than the export's, or that stores none of the export's
    tensors as blocks, is refused in one line, nothing written."""
    root = work.root
    release = tensors(root / "release")
    cut = ("model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.mlp.experts.gate_up_proj_scales")
    narrower = {name: t[:, :-32].contiguous() if name in cut else t for name, t in release.items()}
    config = json.loads((root / "release" / "config.json").read_text())
    release_from(narrower, tmp_path / "narrower", config)
    shutil.copytree(root / "plain", tmp_path / "unquantized")
    (tmp_path / "unquantized" / "config.json").write_text(json.dumps(config))
    for original, expected in (("narrower", "holds MXFP4 values of shape [8, 64, 224], the export's"), ("unquantized", "no tensor of the export")):
        args = ["mcore-to-hf", "--load-dir", str(root / "mcore"), "--save-dir", str(tmp_path / "out"), "--hf-config", str(tmp_path / original)]
        code = main([*args, "--quantize", "as-source"])
        err = capsys.readouterr().err.strip()
        assert code == 1 and len(err.splitlines()) == 1 and err.startswith("mconvert: error: --quantize as-source") and expected in err, err
        assert_nothing_left(tmp_path / "out")


def test_groups_come_back_at_every_exponent_from_1_to_252():
    """dequantize_mxfp4 (the reader's, to bf16) then quantize_mxfp4 gives back random groups whose largest value is 4
    or 6 at every exponent from 1 to 252: their values are exact in bf16 there. At 0 (values below 2^-125) amax / 6
    is below fp32's normal numbers and rounds up to exponent 1, as the reference's bit arithmetic does; from 253 a
    value of 6 passes bf16's largest."""
    generator = np.random.default_rng(0)
    blocks = generator.integers(0, 256, (253, 64, 4, 16), dtype=np.uint8)
    blocks[:, :, :, 0] = blocks[:, :, :, 0] & 0xF8 | np.where(np.arange(64) < 32, 6, 7)[:, None].astype(np.uint8)  # 4 or 6
    blocks[:, :32] -= np.where(blocks[:, :32] & 0x07 == 7, 1, 0).astype(np.uint8)  # no 6 where the largest is 4
    blocks[:, :32] -= np.where(blocks[:, :32] >> 4 & 0x07 == 7, 16, 0).astype(np.uint8)
    scales = np.broadcast_to(np.arange(253, dtype=np.uint8)[:, None, None], blocks.shape[:-1]).copy()
    values = dequantize_mxfp4(blocks, scales)
    assert np.isfinite(values.astype(np.float32)).all()
    back, exponents = quantize_mxfp4(values.astype(np.float32))
    assert np.array_equal(back[1:], blocks[1:]) and np.array_equal(exponents[1:], scales[1:])
    assert (exponents[0] == 1).all()
