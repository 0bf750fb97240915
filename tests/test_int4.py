"""compressed-tensors' pack-quantized INT4 checkpoints (Kimi-K2-Thinking's and Kimi-K2.5's routed experts: int32 words of
eight 4-bit integers, one bf16 scale per group of 32 columns of a row, the weight's shape) convert as their
dequantized values, bit for bit what compressed-tensors' own decompression gives. The test makes shrunk models of
both (mconvert.synthetic, in bf16), quantizes their experts with compressed-tensors itself as Kimi's
quantization_config says (its ignore list keeps attention, the shared experts and the dense MLP in bf16), and
dequantizes them again with compressed-tensors' CompressedTensorsDequantizer: the two conversions agree bit for bit,
and megatron-core on the INT4 one gives the logits transformers gives from the dequantized model. A wrong nibble
order or a scale applied per row instead of per group breaks the agreement; a checkpoint that disagrees with its
config is refused in one line naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file, save_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.formats import hf_checkpoint, quantized
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from tests.test_fp8 import stored
from tests.test_optional_packages import old_release

# Kimi-K2.5's, which Kimi-K2-Thinking's config.json shares: INT4, symmetric, groups of 32, all but the routed experts ignored.
QUANTIZATION = real_config("kimi-k2.5")["text_config"]["quantization_config"]
# Kimi-K2-Thinking: Kimi-K2's architecture (kimi_k2, a DeepSeek-V3; Kimi-K2-Instruct's config stands in for its own)
# with that quantization_config. Kimi-K2.5: its config as released. Experts 96 wide: their down_proj has 3 groups.
MODELS = {
    "kimi-k2-thinking": {**real_config("kimi-k2-instruct"), "quantization_config": QUANTIZATION},
    "kimi-k2.5": real_config("kimi-k2.5"),
}


def quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as Kimi's INT4 releases store it: each linear layer that Kimi's quantization_config does not
    ignore (the routed experts; Kimi's MoE router is no nn.Linear, the output layer is ignored) packed by
    compressed-tensors' compressor, with scales of its own min-max arithmetic; the rest as it is."""
    weights = QuantizationArgs(**QUANTIZATION["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    out = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or any(match_name(module, pattern) for pattern in QUANTIZATION["ignore"]):
            out[name] = tensor
            continue
        scale, zero_point = compute_dynamic_scales_and_zp(tensor, weights, module=None)
        packed = PackedQuantizationCompressor.compress({"weight": tensor, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
        out.update({f"{module}.{key}": value for key, value in packed.items()})
    return out


def write(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def with_quantization(config: dict, quantization: dict | None) -> dict:
    """`config` stating `quantization` where the release states it (Kimi-K2.5: its text_config), or none."""
    inner = "text_config" in config
    target = dict(config["text_config"]) if inner else dict(config)
    target.pop("quantization_config", None)
    if quantization is not None:
        target["quantization_config"] = quantization
    return {**config, "text_config": target} if inner else target


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """model -> (its INT4 checkpoint, the same dequantized by compressed-tensors)."""
    made = {}
    for name, config in MODELS.items():
        root = tmp_path_factory.mktemp(name.replace(".", "_"))
        source = make_hf_checkpoint(shrink(config, moe_intermediate_size=96), root / "source", dtype="bfloat16", weight_std=0.1)
        plain = json.loads((source / "config.json").read_text())
        int4 = write(root / "int4", quantize(load_file(source / "model.safetensors")), with_quantization(plain, QUANTIZATION))
        # compressed-tensors' own dequantization of a checkpoint (its `convert_checkpoint`'s, for one file), checking
        # that no packed tensor is left over; the weights in bf16, the scales' dtype.
        dequantized = CompressedTensorsDequantizer(int4, dtype=torch.bfloat16).validate(load_file(int4 / "model.safetensors"))
        made[name] = int4, write(root / "dequantized", dequantized, with_quantization(plain, None))
    return made


def packed_modules(directory: Path) -> list[str]:
    return [name.removesuffix(".weight_packed") for name in load_file(directory / "model.safetensors") if name.endswith(".weight_packed")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", MODELS)
def test_int4_converts_as_compressed_tensors_dequantizes_it(model, dtype, made, tmp_path):
    int4, dequantized = made[model]
    experts = packed_modules(int4)
    assert len(experts) == 8 * 3 and all(".mlp.experts." in module for module in experts)
    for name, source in (("int4", int4), ("plain", dequantized)):
        convert_hf_to_mcore(source, tmp_path / name, parallelism=Parallelism(tp=2, ep=2), dtype=dtype)
    from_int4, from_plain = stored(tmp_path / "int4"), stored(tmp_path / "plain")
    assert sorted(from_int4) == sorted(from_plain)
    different = [key for key in from_plain if not torch.equal(from_int4[key], from_plain[key])]
    assert not different, different
    assert from_int4["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"].dtype == dtype


def nibbles_swapped():
    """Each byte's high 4 bits read as its first value."""
    return "INT4_PAIRS", np.ascontiguousarray(quantized.INT4_PAIRS[:, ::-1])


def scale_per_row():
    """Each row's first scale applied to its whole row."""
    real = quantized.dequantize_int4
    return "dequantize_int4", lambda packed, scales, columns, zeros=None: real(packed, np.repeat(scales[:, :1], scales.shape[1], 1), columns, zeros)


@pytest.mark.parametrize("fault", [nibbles_swapped, scale_per_row])
def test_an_injected_fault_breaks_the_bit_for_bit_agreement(fault, made, tmp_path, monkeypatch):
    """What the test above is for: a reader that takes a byte's nibbles in the other order, or applies a row's first
    scale to all its groups, converts the experts to other values than compressed-tensors' (every expert tensor
    differs), and nothing else."""
    int4, dequantized = made["kimi-k2-thinking"]
    name, faulty = fault()
    monkeypatch.setattr(quantized if name == "INT4_PAIRS" else hf_checkpoint, name, faulty)
    for out, source in (("int4", int4), ("plain", dequantized)):
        convert_hf_to_mcore(source, tmp_path / out, parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
    from_int4, from_plain = stored(tmp_path / "int4"), stored(tmp_path / "plain")
    different = sorted(key for key in from_plain if not torch.equal(from_int4[key], from_plain[key]))
    assert different == ["decoder.layers.1.mlp.experts.experts.linear_fc1.weight", "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"]


@pytest.mark.parametrize("model", MODELS)
def test_megatron_core_gives_the_logits_transformers_gives_from_the_int4_checkpoint(model, made, tmp_path):
    """`mconvert verify` runs megatron-core (gloo CPU ranks, TP 2, EP 2) on the conversion of the INT4 checkpoint, and
    transformers on the INT4 checkpoint itself, which it dequantizes through compressed-tensors as it loads (Kimi-K2.5:
    its language model, which transformers builds from its text_config). compressed-tensors' own dequantization
    converts bit for bit as the INT4 checkpoint does (test_int4_converts_as_compressed_tensors_dequantizes_it), so it
    is not verified again here."""
    int4, _ = made[model]
    assert run_cli("hf-to-mcore", "--load-dir", int4, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2").returncode == 0
    passed = run_cli("verify", "--hf", int4, "--mcore", tmp_path / "mcore", "--tp", "2", "--ep", "2", "--device", "cpu")
    assert passed.returncode == 0 and passed.stdout.strip().endswith("PASS"), passed.stdout + passed.stderr
    assert "UNEXPECTED" not in passed.stderr  # Kimi-K2.5's vision tower is not the language model's: no load report of it


def test_the_reference_tells_the_int4_model_from_the_one_before_quantization(made, tmp_path):
    """The control of the test above: the same weights before quantization (a bf16 Kimi-K2.5, vision tower included)
    are another model than the INT4 one, and verify says so."""
    int4, _ = made["kimi-k2.5"]
    assert run_cli("hf-to-mcore", "--load-dir", int4, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2").returncode == 0
    failed = run_cli("verify", "--hf", int4.parent / "source", "--mcore", tmp_path / "mcore", "--tp", "2", "--ep", "2", "--device", "cpu")
    assert failed.returncode == 1 and "FAIL" in failed.stdout, failed.stdout + failed.stderr


def test_kimi_k25_leaves_out_its_vision_tower_and_the_export_copies_it_unquantizing_the_rest(made, tmp_path):
    """hf-to-mcore says what it leaves out; mcore-to-hf with the original as --hf-config writes Kimi-K2.5 back: the
    vision tower and projector copied bit for bit, the language model in bf16 bit for bit compressed-tensors'
    dequantization, config.json Kimi's own (kimi_k25 around kimi_k2) without the quantization_config."""
    int4, dequantized = made["kimi-k2.5"]
    out = run_cli("hf-to-mcore", "--load-dir", int4, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2")
    assert out.returncode == 0, out.stderr
    assert "its language model (text_config) read as DeepseekV3ForCausalLM (the deepseek family)" in out.stdout
    assert f"left out the vision tower of {int4}: 17 tensors" in out.stdout
    assert f"left out the multimodal projector of {int4}: 6 tensors" in out.stdout
    back = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back", "--hf-config", int4)
    assert back.returncode == 0, back.stderr
    assert f"wrote the weights unquantized: config.json leaves out the quantization_config of {int4}" in back.stdout
    written, reference = load_file(tmp_path / "back" / "model-00001-of-00001.safetensors"), load_file(dequantized / "model.safetensors")
    assert f"{len(written)} tensors (23 of them copied from --hf-config)" in back.stdout
    assert written.keys() == reference.keys() and all(torch.equal(written[name], reference[name]) for name in reference)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["text_config"]["model_type"]) == ("kimi_k25", ["KimiK25ForConditionalGeneration"], "kimi_k2")
    assert "quantization_config" not in config["text_config"] and config["text_config"]["auto_map"] == MODELS["kimi-k2.5"]["text_config"]["auto_map"]


def edited(int4: Path, out: Path, tensors=lambda t: t, quantization=QUANTIZATION) -> Path:
    """The INT4 checkpoint with its tensors and quantization_config changed."""
    config = json.loads((int4 / "config.json").read_text())
    return write(out, tensors(load_file(int4 / "model.safetensors")), with_quantization(config, quantization))


def without(name: str):
    return lambda tensors: {key: value for key, value in tensors.items() if key != name}


EXPERT = "model.layers.1.mlp.experts.3.down_proj"
MISMATCHES = {
    # The config ignores what the checkpoint holds packed.
    "ignored": (lambda int4, out: edited(int4, out, quantization={**QUANTIZATION, "ignore": [*QUANTIZATION["ignore"], "re:.*experts.*"]}),
                ("model.layers.1.mlp.experts.0.down_proj.weight_packed", "ignores it ('re:.*experts.*')")),
    # Scales of groups of 32 where the config says 16.
    "group size": (lambda int4, out: edited(int4, out, quantization={**QUANTIZATION, "config_groups": {"group_0": {
        **QUANTIZATION["config_groups"]["group_0"], "weights": {**QUANTIZATION["config_groups"]["group_0"]["weights"], "group_size": 16}}}}),
                   ("model.layers.1.mlp.experts.0.down_proj.weight_packed", "one scale per 16 columns")),
    "no scale": (lambda int4, out: edited(int4, out, without(f"{EXPERT}.weight_scale")), (f"{EXPERT}.weight_packed", f"{EXPERT}.weight_scale")),
    "no shape": (lambda int4, out: edited(int4, out, without(f"{EXPERT}.weight_shape")), (f"{EXPERT}.weight_packed", f"{EXPERT}.weight_shape")),
    # Zero points the symmetric config has none of.
    "zero points": (lambda int4, out: edited(int4, out, lambda t: {**t, f"{EXPERT}.weight_zero_point": torch.zeros(4, 3, dtype=torch.int32)}),
                    (f"{EXPERT}.weight_packed", "no zero points (symmetric)")),
    # INT4 by the config, none stored.
    "nothing packed": (lambda int4, out: edited(int4.parent / "dequantized", out), ("names pack-quantized INT4 weights", "no *.weight_packed")),
    "8 bits": (lambda int4, out: edited(int4, out, quantization={**QUANTIZATION, "config_groups": {"group_0": {
        **QUANTIZATION["config_groups"]["group_0"], "weights": {**QUANTIZATION["config_groups"]["group_0"]["weights"], "num_bits": 8}}}}),
               ("config.json", "config_groups.group_0 weights of type int, num_bits 8")),
}


@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_a_checkpoint_its_config_does_not_describe_is_refused_in_one_line(mismatch, made, tmp_path):
    make, names = MISMATCHES[mismatch]
    source = make(made["kimi-k2-thinking"][0], tmp_path / "hf")
    result = run_cli("hf-to-mcore", "--load-dir", source, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, *names)
    assert_nothing_left(tmp_path / "out")


def test_verify_of_an_int4_source_with_compressed_tensors_too_old_is_one_line(made, tmp_path):
    """transformers dequantizes the INT4 checkpoint through compressed-tensors: verify names it when it is missing or
    too old, before running anything."""
    int4, _ = made["kimi-k2-thinking"]
    convert_hf_to_mcore(int4, tmp_path / "mcore")
    older = old_release(tmp_path, "compressed-tensors", "0.19.0")
    result = run_cli("verify", "--hf", int4, "--mcore", tmp_path / "mcore", "--device", "cpu", python_path=older)
    assert_one_line_error(result, f"verify of the INT4 checkpoint {int4}", "compressed-tensors>=0.20 (0.19.0 is installed)", code=2)
