"""`mcore-to-hf --quantize as-source` of gpt-oss's MXFP4 release: the experts' gate_up_proj and down_proj written as
`_blocks` and `_scales` again, held bit for bit to a reference quantizer, and the release -> bf16 -> Megatron ->
release round trip.

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
    from, in fp32), with their exports in fp32. `reference`: the reference quantizer's output for those weights."""
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
    return SimpleNamespace(root=root, weights=weights, reference=expected)


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


def nibbles_swapped(values):
    blocks, scales = quantize_mxfp4(values)
    return (blocks & 0x0F) << 4 | blocks >> 4, scales


def scales_off_by_one(values):
    blocks, scales = quantize_mxfp4(values)
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
    assert not_given_back(root / "release", tmp_path / "back") == sorted(QUANTIZED)


def groups(blocks: torch.Tensor) -> torch.Tensor:
    """Each group's largest magnitude, in its codes."""
    return torch.maximum(MAGNITUDES[(blocks & 0x0F).long()], MAGNITUDES[(blocks >> 4).long()]).amax(-1)


def not_given_back(release_dir, back_dir) -> list[str]:
    """The tensors of the release that the export `back_dir` does not give back as the round trip can: byte for byte
    every tensor but the experts, and of theirs every group whose largest code is 4 or 6, or that is zeros with
    exponent 0 (the groups the reference makes and the OCP rule makes); a group whose largest code is 3 (its scale s
    not the one a quantizer finds from its values: 3 s is 6 (s / 2)) as the same values, in that group's codes
    doubled at half its scale."""
    release, back = tensors(release_dir), tensors(back_dir)
    wrong = sorted(name for name in release.keys() ^ back.keys())
    for name in (n for n in release if n in back and not n.endswith(("_blocks", "_scales"))):
        if not torch.equal(release[name], back[name]):
            wrong.append(name)
    for name in (n.removesuffix("_blocks") for n in release if n.endswith("_blocks") and n in back):
        blocks, scales, blocks_back, scales_back = release[name + "_blocks"], release[name + "_scales"], back[name + "_blocks"], back[name + "_scales"]
        largest = groups(blocks)
        exact = (largest >= 4) | (largest == 0) & (scales == 0)
        threes = largest == 3
        same = (blocks_back == blocks).all(-1) & (scales_back == scales)
        values_kept = torch.equal(convert_moe_packed_tensors(blocks, scales), convert_moe_packed_tensors(blocks_back, scales_back))
        halved = (scales_back == scales - 1) & (groups(blocks_back) == 6)
        if not (same[exact].all() and halved[threes].all() and values_kept and (exact | threes).all()):
            wrong.append(name)
    return wrong


def test_the_round_trip_gives_back_the_releases_bytes_but_groups_whose_largest_code_is_3(work):
    """Release -> hf-to-mcore (bf16, which holds MXFP4 values exactly: a 4-bit float times a power of two) ->
    mcore-to-hf --quantize as-source. Where a group's largest value quantized to 3 (about log2(3.5 / 3), 22 %, of the
    reference's groups of normal weights: amax / scale in (3, 3.5)), its values are those of codes twice as large at
    half the scale, and any quantizer given the values alone finds that scale: such a group comes back as its values,
    not its bytes. Every other group, and every other tensor, comes back byte for byte."""
    release = tensors(work.root / "release")
    for name in (n for n in release if n.endswith("_blocks")):
        blocks, scales = release[name], release[name.replace("_blocks", "_scales")]
        assert torch.equal(convert_moe_packed_tensors(blocks, scales).float(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        assert 0.1 < (groups(blocks) == 3).float().mean() < 0.4
    zeros = release["model.layers.1.mlp.experts.down_proj_blocks"][3, 5, 0]
    assert not zeros.any() and release["model.layers.1.mlp.experts.down_proj_scales"][3, 5, 0] == 0
    assert not_given_back(work.root / "release", work.root / "mxfp4") == []


def test_an_export_comes_back_byte_for_byte(work, tmp_path):
    """The export holds only groups that the round trip gives back (largest code 4 or 6, or zeros): the export as
    the release -> hf-to-mcore -> mcore-to-hf --quantize as-source gives back every byte of every tensor."""
    original = tensors(work.root / "mxfp4")
    assert all(((groups(t) >= 4) | (groups(t) == 0)).all() for name, t in original.items() if name.endswith("_blocks"))
    convert_hf_to_mcore(work.root / "mxfp4", tmp_path / "mcore", parallelism=LAYOUT)
    export(tmp_path / "mcore", tmp_path / "back", work.root / "mxfp4")
    back = tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[name], back[name]) for name in original)


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
