"""gpt-oss converted to torch_dist and checked by megatron-core 0.16.1 (its GPTModel, local spec, gloo CPU ranks) at
TP 2 x EP 2 (ETP 1: megatron-core takes biased experts only there) and PP 2: attention with biases and a learned
sink per head, a window on every other layer, YaRN that does not round its correction range, a router with a
bias, experts with biases and a clamped, offset quick-GELU gate. The prompts are longer than the window, the sinks
large enough to move the softmax. Injected faults (sinks zeroed, the window on the other layer, gate and up not
de-interleaved) each move megatron-core's logits away from transformers'; the conversion back is bit-exact."""

from __future__ import annotations

import dataclasses
import json

import pytest
import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from mconvert.dtypes import as_torch
from mconvert import mappings
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.mappings import gpt_oss
from mconvert.mappings.transforms import Rename, Transpose
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import assert_one_line_error, run_cli
from tests.test_moe_megatron import megatron_view

WINDOW = 4
TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))  # three windows long
LAYOUTS = {"tp2-ep2-etp1": Parallelism(tp=2, ep=2, etp=1), "pp2": Parallelism(pp=2)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    config = shrink(real_config("gpt-oss-20b"), layers=2, sliding_window=WINDOW)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    return sharpened(make_hf_checkpoint(config, tmp_path_factory.mktemp("gpt_oss") / "hf"))


def sharpened(hf_dir):
    """Weights at std 0.1 (not make_hf_checkpoint's 0.05) and sinks of a few units, so that attention is far
    from uniform and a sink takes a share of it that shows."""
    tensors = load_file(hf_dir / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("sinks"):
            tensor.mul_(3.0)
        elif tensor.dim() > 1:
            tensor.mul_(2.0)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


def hf_logits(hf_dir, tokens=TOKENS) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def megatron_logits(ckpt, parallelism: Parallelism) -> torch.Tensor:
    views = run_ranks(megatron_view, {"model": str(ckpt)}, TOKENS, tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, etp=parallelism.etp)
    return views["model"][0][..., :1000]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_core_gives_transformers_logits_and_the_export_is_bit_exact(layout, hf, tmp_path):
    parallelism = LAYOUTS[layout]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    torch.testing.assert_close(megatron_logits(tmp_path / "mcore", parallelism), hf_logits(hf), rtol=1e-4, atol=1e-4)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")  # from the stored args alone
    original, back = load_file(hf / "model.safetensors"), {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(path))
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", hf))
    for field in ("model_type", "layer_types", "sliding_window", "swiglu_limit", "attention_bias", "num_local_experts", "num_experts_per_tok"):
        assert written[field] == read[field], field
    assert written["rope_scaling"]["truncate"] is False and written["rope_scaling"]["factor"] == 32.0


def test_the_prompts_exercise_the_sinks_and_the_window(hf, tmp_path):
    """Without either, transformers' own logits move: the prompts are such that a conversion that lost them would
    show (the same faults in the conversion: test_an_injected_fault_moves_megatrons_logits)."""
    reference = hf_logits(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        assert (model(TOKENS).logits - reference).abs().max() > 1e-2
    config = json.loads((hf / "config.json").read_text())
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "model.safetensors").symlink_to(hf / "model.safetensors")
    (wide / "config.json").write_text(json.dumps({**config, "sliding_window": len(TOKENS[0])}))
    assert config["sliding_window"] == WINDOW and (hf_logits(wide) - reference).abs().max() > 1e-2


class Zeroed(Rename):
    def to_mcore(self, tensors, spec):
        return np.zeros_like(tensors[0])

    def to_mcore_parts(self, tensors, spec):
        return [self.to_mcore(tensors, spec)]


def family_with(attention=None, experts=None):
    """The gpt-oss family with its attention or experts entries replaced."""
    table = dataclasses.replace(
        gpt_oss.TABLE, attention=attention or gpt_oss.TABLE.attention, fused_experts=experts or gpt_oss.TABLE.fused_experts
    )
    return dataclasses.replace(gpt_oss.FAMILY, table=table)


def stored_args_changed(ckpt, **changes):
    common = iteration_dir(ckpt) / "common.pt"
    state = torch.load(common, weights_only=False)
    vars(state["args"]).update(changes)
    torch.save(state, common)


STORED_ARGS_FAULTS = {
    "window on the other layer": {"window_attn_skip_freq": [0, 1]},
    # As transformers' run without the window above: every prompt within it.
    "window as long as the prompts": {"window_size": (len(TOKENS[0]) - 1, 0)},
}


@pytest.mark.parametrize("fault", ["sinks zeroed", *STORED_ARGS_FAULTS, "gate and up not de-interleaved"])
def test_an_injected_fault_moves_megatrons_logits(fault, hf, tmp_path, monkeypatch):
    if fault == "sinks zeroed":
        attention = tuple(Zeroed(e.mcore, e.hf, split=e.split) if e.mcore.endswith("softmax_offset") else e for e in gpt_oss.TABLE.attention)
        monkeypatch.setitem(mappings.FAMILIES, "gpt_oss", family_with(attention=attention))
    elif fault == "gate and up not de-interleaved":
        experts = tuple(Transpose(e.mcore, e.hf, split=e.split) if e.mcore == "linear_fc1.weight" else e for e in gpt_oss.TABLE.fused_experts)
        monkeypatch.setitem(mappings.FAMILIES, "gpt_oss", family_with(experts=experts))
    parallelism = LAYOUTS["tp2-ep2-etp1"]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    if fault in STORED_ARGS_FAULTS:
        stored_args_changed(tmp_path / "mcore", **STORED_ARGS_FAULTS[fault])
    assert (megatron_logits(tmp_path / "mcore", parallelism) - hf_logits(hf)).abs().max() > 1e-2


def test_the_printed_verify_command_runs_as_printed_and_a_wrong_etp_is_one_line(hf, tmp_path):
    """hf-to-mcore's `next:` verify command carries --etp; verify checks a layout by hf-to-mcore's rules."""
    out = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2", "--etp", "1")
    assert out.returncode == 0, out.stderr
    (printed,) = [line.split("#")[0].split() for line in out.stdout.splitlines() if line.strip().startswith("mconvert verify")]
    assert "--etp" in printed
    passed = run_cli(*printed[1:-2], "--device", "cpu")  # as printed, on CPU ranks instead of GPUs
    assert passed.returncode == 0 and passed.stdout.strip().endswith("PASS"), passed.stdout + passed.stderr
    wrong = run_cli("verify", "--hf", hf, "--mcore", tmp_path / "mcore", "--tp", "2", "--ep", "2", "--device", "cpu")
    assert_one_line_error(wrong, "--etp 2", "--etp 1", code=2)


def test_mxfp4_hub_weights_convert_as_transformers_dequantizes_them(hf, tmp_path):
    """gpt-oss as released: each layer's experts stored as MXFP4 (`gate_up_proj_blocks` [E, 2I, H/32, 16] bytes of two
    4-bit floats, `gate_up_proj_scales` [E, 2I, H/32] exponents; `down_proj` alike), `quant_method: mxfp4`. They
    convert as the bf16 weights transformers' own dequantization makes of them; mcore-to-hf writes those, without
    the quantization_config, and says so."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mconvert.cli import main
    from mconvert.formats.dcp import DCPCheckpoint

    config = {**json.loads((hf / "config.json").read_text()), "torch_dtype": "bfloat16"}
    generator = torch.Generator().manual_seed(0)
    packed, plain = {}, {}
    for name, tensor in load_file(hf / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = plain[name] = tensor.to(torch.bfloat16)
            continue
        experts, inputs, outputs = tensor.shape  # transformers' [in, out]; MXFP4 groups 32 inputs of each output
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(122, 130, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=generator)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        assert plain[name].shape == tensor.shape
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    for directory, tensors, extra in ((tmp_path / "mxfp4", packed, {"quantization_config": quantization}), (tmp_path / "bf16", plain, {})):
        directory.mkdir()
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        convert_hf_to_mcore(directory, tmp_path / f"{directory.name}-mcore", parallelism=Parallelism(tp=2, ep=2, etp=1))
    stored = [DCPCheckpoint(iteration_dir(tmp_path / f"{name}-mcore")) for name in ("mxfp4", "bf16")]
    assert sorted(stored[0].shapes) == sorted(stored[1].shapes)
    for key, shape in stored[1].shapes.items():
        assert torch.equal(*(as_torch(dcp.read_region(key, (0,) * len(shape), shape)) for dcp in stored)), key
    assert main(["mcore-to-hf", "--load-dir", str(tmp_path / "mxfp4-mcore"), "--save-dir", str(tmp_path / "back"), "--hf-config", str(tmp_path / "mxfp4")]) == 0
    back = {k: v for path in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(path).items()}
    assert back.keys() == plain.keys() and all(torch.equal(back[k], plain[k]) for k in plain)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    # verify runs transformers on its own dequantization of the blocks (running them as MXFP4 needs kernels and a GPU)
    checked = run_cli("verify", "--hf", tmp_path / "mxfp4", "--mcore", tmp_path / "mxfp4-mcore", "--tp", "2", "--ep", "2", "--etp", "1", "--device", "cpu")
    assert checked.returncode == 0 and checked.stdout.strip().endswith("PASS"), checked.stdout + checked.stderr


def test_random_mxfp4_checkpoints_are_the_hubs_layout(tmp_path):
    """What the conversion benchmark reads as gpt-oss as released: its experts as MXFP4 blocks and exponents, the
    quantization_config kept; converting as transformers' dequantization of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mconvert.formats.dcp import DCPCheckpoint
    from mconvert.full_size import write_random_hf_checkpoint

    config = {**shrink(real_config("gpt-oss-20b"), layers=2), "torch_dtype": "bfloat16", "quantization_config": real_config("gpt-oss-20b")["quantization_config"]}
    hf = write_random_hf_checkpoint(config, tmp_path / "hf", quantized=True)
    assert json.loads((hf / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    assert tensors[name + "_blocks"].dtype == torch.uint8 and name not in tensors
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(ep=2, etp=1))
    dcp = DCPCheckpoint(iteration_dir(tmp_path / "mcore"))
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"  # [layer, expert, out, in]: gpt-oss's layers alike
    converted = as_torch(dcp.read_region(key, (0,) * len(dcp.shapes[key]), dcp.shapes[key]))[1, 3]
    expected = convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"])[3].T
    assert torch.equal(converted, expected)
