"""Megatron-Bridge's LoRA on an MoE model's experts (tests/fixtures/megatron_bridge_lora/moe-lora, made by its own
code on CPU ranks at EP 1 and 2: an adapter per expert) exported by `adapter-to-hf` as PEFT adapters of transformers'
fused 3-D expert parameters (`target_parameters`): peft gives Megatron-Bridge's logits, and lora_B written
expert-major (Megatron-Bridge's own HF export layout) or experts' adapters shifted by one expert fail the check. Its
LoRA on the router is refused. The merged export of these saves is in test_adapters.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_adapters import FIXTURE, LOGITS_TOLERANCE, base_of, export, logits_error, logits_of, peft_model

from mconvert.cli import main
from mconvert.converters.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MOE_EXPERTS = 4  # the moe-lora fixture's


def _expert_major(adapter: Path) -> None:
    """The experts' lora_B written expert-major ([out, E, r], as Megatron-Bridge 0.6's own HF export of grouped experts
    writes it), which PEFT reads rank-major ([out, r, E])."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    for name in [n for n in tensors if ".experts." in n and n.endswith("lora_B.weight")]:
        b = tensors[name]
        tensors[name] = b.reshape(b.shape[0], -1, MOE_EXPERTS).transpose(1, 2).reshape(b.shape[0], -1).contiguous()
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS))


def _experts_shifted(adapter: Path) -> None:
    """Each expert's adapter given to the next expert (an expert-parallel offset gone wrong)."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    for name in [n for n in tensors if ".experts." in n]:
        t = tensors[name]
        tensors[name] = (t.reshape(MOE_EXPERTS, -1, t.shape[1]).roll(1, 0).reshape(t.shape) if "lora_A" in name
                         else t.reshape(t.shape[0], -1, MOE_EXPERTS).roll(1, 2).reshape(t.shape)).contiguous()
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS))


@pytest.mark.parametrize("save", ["moe-lora", "moe-lora-ep2"])
def test_peft_gives_megatron_bridges_logits_with_its_expert_adapters(save, tmp_path):
    """Megatron-Bridge's LoRA on a Qwen3-MoE model's attention and on every expert's linear_fc1 and linear_fc2 (one
    adapter per expert), saved at EP 1 and EP 2: PEFT adapts transformers' fused gate_up_proj and down_proj as
    parameters."""
    adapter = export(save, tmp_path / "adapter")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["k_proj", "o_proj", "q_proj", "v_proj"])
    assert config["target_parameters"] == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]
    assert logits_error(adapter, save) < LOGITS_TOLERANCE
    reference = logits_of(save)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_of(save), dtype=torch.float32)(reference["tokens"]).logits
        assert (base - reference["logits"]).abs().max().item() > 0.1
        # The experts' adapters matter on their own: without them the logits are off too.
        model = peft_model(adapter, base_of(save))
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.ParamWrapper):
                module.scaling = {name: 0.0 for name in module.scaling}
        assert (model(reference["tokens"]).logits - reference["logits"]).abs().max().item() > 100 * LOGITS_TOLERANCE


@pytest.mark.parametrize("fault", [_expert_major, _experts_shifted])
def test_each_expert_fault_fails_the_check(fault, tmp_path):
    adapter = export("moe-lora", tmp_path / "adapter")
    fault(adapter)
    assert logits_error(adapter, "moe-lora") > 100 * LOGITS_TOLERANCE


def test_megatron_bridges_router_adapters_are_refused_in_one_line(tmp_path, capsys):
    """Megatron-Bridge's own save of a Qwen3-MoE model's LoRA on its router (transformers' router is no nn.Linear)."""
    moe = FIXTURE / "moe"
    code = main(["adapter-to-hf", "--load-dir", str(moe / "router" / "checkpoint"), "--hf-config", str(moe), "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    expected = "'decoder.layers.mlp.router.adapter.linear_in.weight': adapters on the MoE router are not exported yet"
    assert code == 1 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
