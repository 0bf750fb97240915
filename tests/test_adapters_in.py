"""`adapter-to-mcore`: HF PEFT LoRA adapters (made here by peft on the Megatron-Bridge fixture's base model, weights
at std 0.1) written as Megatron-Bridge adapter-only checkpoints.

Judged by Megatron-Bridge 0.6.2 itself on gloo CPU ranks, Python 3.12 with megatron-core 0.19.2: its `LoRA`, built
from the written run_config.yaml's `peft:` section, wraps megatron-core's GPTModel (the base converted by
hf-to-mcore at TP 1 and 2) and loads the adapter as its own adapter loading does (the model's sharded state dict
filtered by the LoRA's adapter_key_filter, dist_checkpointing.load, every key on both sides matched); its logits
are peft + transformers' for the same tokens. A lora_A/lora_B orientation swap and a wrong scale in the written
checkpoint move them far off. Those tests need MCONVERT_MEGATRON_BRIDGE, the directory Megatron-Bridge was
installed into (`pip install --no-deps --target /tmp/mb megatron-bridge==0.6.2`); the rest runs anywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from mconvert.cli import main
from mconvert.converters import adapters_in
from mconvert.converters.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "tests" / "fixtures" / "megatron_bridge_lora" / "hf"
BRIDGE = os.environ.get("MCONVERT_MEGATRON_BRIDGE")
HAVE_BRIDGE = bool(BRIDGE and (Path(BRIDGE) / "megatron" / "bridge").is_dir() and importlib.util.find_spec("megatron.training"))
if BRIDGE and not HAVE_BRIDGE:  # named (as CI's Python 3.12 run names it), so its tests must run, not skip
    raise RuntimeError(f"MCONVERT_MEGATRON_BRIDGE={BRIDGE}: no Megatron-Bridge there, or no megatron.training here")
peft = importlib.import_module("peft") if BRIDGE else pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
needs_bridge = pytest.mark.skipif(not HAVE_BRIDGE, reason="Megatron-Bridge (MCONVERT_MEGATRON_BRIDGE) with megatron-core >= 0.19")
TOKENS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(7))
# fp32 on both sides: the logits agree to about 1e-6; a wrong adapter moves them by 0.1 or more.
LOGITS_TOLERANCE = 1e-4
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(out: Path, targets=EVERY, shared: bool = True, seed: int = 0, base: Path = BASE, **lora) -> Path:
    """peft's own adapter of the `base` model, its weights at random (std 0.1); `shared`: q/k/v (and gate/up) of a
    layer with one lora_A, as Megatron-Bridge's LoRA on a fused linear has."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": list(targets), **lora}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        for layer in model.base_model.model.model.layers if shared else ():
            fused = [[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")], [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj")]]
            for first, *others in fused:
                for other in others:
                    if hasattr(first, "lora_A") and hasattr(other, "lora_A"):
                        other.lora_A["default"].weight.copy_(first.lora_A["default"].weight)
    model.save_pretrained(out)
    return out


def peft_logits(adapter: Path, base: Path = BASE) -> torch.Tensor:
    base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(base, adapter).eval()(TOKENS).logits


def to_mcore(adapter: Path, out: Path, *flags: str, base: Path = BASE) -> Path:
    assert main(["adapter-to-mcore", "--adapter", str(adapter), "--hf-config", str(base), "--save-dir", str(out), *flags]) == 0
    return out


def bridge_model_with_adapter(site: str, base: str, adapter: str) -> tuple[torch.nn.Module, object]:
    """On each rank: the base model wrapped by Megatron-Bridge's LoRA of the adapter checkpoint's run_config.yaml (in
    the iteration directory `adapter`), the adapter loaded as Megatron-Bridge loads one; and the LoRA."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from mconvert.mcore.checkpoint import RELEASE, read_args
    from mconvert.verify.megatron_side import load_model

    if "megatron.bridge.peft.lora" not in sys.modules:  # entered once a process, as the fixture script enters it
        spec = importlib.util.spec_from_file_location("megatron_bridge_lora", REPO / "scripts" / "fixtures" / "megatron_bridge_lora.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        script.import_megatron_bridge_lora(site)
    lora = sys.modules["megatron.bridge.peft.lora"]
    settings = yaml.safe_load((Path(adapter) / "run_config.yaml").read_text())["peft"]
    assert settings.pop("_target_") == "megatron.bridge.peft.lora.LoRA"
    settings = {k: v for k, v in settings.items() if k in ("target_modules", "dim", "alpha", "dropout")}
    bridge_lora = lora.LoRA(**settings)
    (model,) = load_model(base, read_args(Path(base) / RELEASE), torch.float32, transformer_impl="local")
    model = bridge_lora(model, training=False)
    # AutoBridge.export_adapter_ckpt's loading (training.checkpointing's helpers it calls import modelopt): what
    # apply_peft_adapter_filter_to_state_dict keeps of the model's sharded state dict, every key matched both ways.
    wanted = {k: v for k, v in model.sharded_state_dict().items() if bridge_lora.adapter_key_filter(k) and "_extra_state" not in k}
    loaded = dist_checkpointing.load({"model": wanted}, adapter, strict=StrictHandling.RAISE_ALL)
    result = model.load_state_dict(loaded["model"], strict=False)
    adapter_params = {name for name, _ in model.named_parameters() if ".adapter." in name}
    assert adapter_params and not result.unexpected_keys and not adapter_params & set(result.missing_keys), result
    return model, bridge_lora


def bridge_logits_with_adapters(site: str, base: str, adapters: list[str], tokens: torch.Tensor) -> list[torch.Tensor]:
    """On each rank: Megatron-Bridge's logits with each adapter checkpoint (rank 0's, gathered over TP)."""
    from mconvert.verify.megatron_side import forward_logits

    return [forward_logits([bridge_model_with_adapter(site, base, str(Path(a) / "release"))[0]], tokens)[..., :256].clone() for a in adapters]


def base_checkpoint(tmp_path: Path, tp: int, hf: Path = BASE) -> Path:
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.parallelism import Parallelism

    base = tmp_path / f"base-tp{tp}"
    convert_hf_to_mcore(hf, base, parallelism=Parallelism(tp=tp))
    return base


def bridge_errors(tmp_path: Path, tp: int, adapters: dict[str, tuple[Path, Path]], hf: Path = BASE) -> dict[str, float]:
    """Largest difference between Megatron-Bridge's logits with each written checkpoint and peft's with its adapter."""
    from mconvert.verify.distributed import run_ranks

    base = base_checkpoint(tmp_path, tp, hf)
    logits = run_ranks(bridge_logits_with_adapters, BRIDGE, str(base), [str(c) for _, c in adapters.values()], TOKENS, tp=tp, timeout_s=300)
    return {name: (bridge - peft_logits(peft_dir, hf)).abs().max().item() for (name, (peft_dir, _)), bridge in zip(adapters.items(), logits)}


@needs_bridge
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_bridge_loads_the_adapter_and_gives_peft_logits(tp, tmp_path):
    every = make_peft_adapter(tmp_path / "every")
    # q and v only (k gets lora_B rows of zeros), on layer 1 only (layer 0's adapters all zeros), rsLoRA.
    some = make_peft_adapter(tmp_path / "some", ["q_proj", "v_proj", "up_proj"], seed=1, layers_to_transform=[1], use_rslora=True)
    adapters = {name: (path, to_mcore(path, tmp_path / f"{name}-mcore", "--tp", str(tp))) for name, path in (("every", every), ("some", some))}
    settings = yaml.safe_load((adapters["some"][1] / "release" / "run_config.yaml").read_text())
    assert settings["peft"]["target_modules"] == ["linear_qkv", "linear_fc1"]
    assert settings["model"]["tensor_model_parallel_size"] == tp
    errors = bridge_errors(tmp_path, tp, adapters)
    assert max(errors.values()) < LOGITS_TOLERANCE, errors
    # The adapters matter: the base alone is far from peft's model with them.
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)(TOKENS).logits
    assert min((base - peft_logits(p)).abs().max().item() for p, _ in adapters.values()) > 0.1


def _swapped(modules):
    """linear_proj's lora_A written as its lora_B's transpose and lora_B as lora_A's (the shapes still load)."""
    return [
        dataclasses.replace(m, lora_a=m.lora_b.T.copy(), lora_b=m.lora_a.T.copy()) if m.module.endswith("linear_proj") else m
        for m in modules
    ]


@needs_bridge
def test_each_fault_in_the_written_checkpoint_fails_the_check(tmp_path, monkeypatch):
    adapter = make_peft_adapter(tmp_path / "peft")
    bridge_modules, run_config = adapters_in.bridge_modules, adapters_in.run_config
    monkeypatch.setattr(adapters_in, "bridge_modules", lambda *a: _swapped(bridge_modules(*a)))
    swapped = to_mcore(adapter, tmp_path / "swapped")
    monkeypatch.undo()
    # alpha written as the dim: a scale of 1 where PEFT's lora_alpha / r is 2.
    monkeypatch.setattr(adapters_in, "run_config", lambda s, *a: run_config(dataclasses.replace(s, alpha=s.dim), *a))
    wrong_scale = to_mcore(adapter, tmp_path / "scale")
    monkeypatch.undo()
    errors = bridge_errors(tmp_path, 1, {"orientation": (adapter, swapped), "scale": (adapter, wrong_scale)})
    assert min(errors.values()) > 100 * LOGITS_TOLERANCE, errors


def test_adapter_to_hf_gives_back_the_same_tensors(tmp_path):
    """PEFT -> Megatron-Bridge -> PEFT: every tensor as it was, the scale too."""
    adapter = make_peft_adapter(tmp_path / "peft")
    to_mcore(adapter, tmp_path / "mcore", "--tp", "2")
    assert main(["adapter-to-hf", "--load-dir", str(tmp_path / "mcore"), "--hf-config", str(BASE), "--save-dir", str(tmp_path / "back")]) == 0
    original, back = load_file(adapter / ADAPTER_WEIGHTS), load_file(tmp_path / "back" / ADAPTER_WEIGHTS)
    assert sorted(original) == sorted(back) and all(torch.equal(original[n], back[n]) for n in original)
    config = json.loads((tmp_path / "back" / ADAPTER_CONFIG).read_text())
    assert config["lora_alpha"] / config["r"] == 2


def _config_with(adapter: Path, **changes) -> Path:
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(dict(config, **changes)))
    return adapter


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: make_peft_adapter(p, shared=False), (
            "'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight' differs from "
            "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': Megatron-Bridge's LoRA on the fused linear_qkv shares one lora_A"
        )),
        (lambda p: make_peft_adapter(p, ["q_proj", "lm_head"]), "tensor 'base_model.model.lm_head.base_layer.weight' is not a LoRA lora_A or lora_B weight"),
        (lambda p: _config_with(make_peft_adapter(p, ["q_proj"]), use_dora=True), "use_dora is True; Megatron-Bridge's LoRA has no such setting"),
        (lambda p: _config_with(make_peft_adapter(p, ["q_proj"]), rank_pattern={"q_proj": 4}), "rank_pattern is {'q_proj': 4}"),
        (lambda p: _config_with(make_peft_adapter(p, ["q_proj"]), r=4), "do not adapt a [64, 64] weight at r=4"),
        (lambda p: _config_with(make_peft_adapter(p, ["q_proj"]), peft_type="IA3"), "peft_type is 'IA3'; adapter-to-mcore writes LoRA adapters only"),
    ],
    ids=["unshared_lora_a", "lm_head", "dora", "rank_pattern", "wrong_r", "not_lora"],
)
def test_what_megatron_bridges_lora_cannot_hold_is_refused_in_one_line(make, expected, tmp_path, capsys):
    adapter = make(tmp_path / "peft")
    capsys.readouterr()
    code = main(["adapter-to-mcore", "--adapter", str(adapter), "--hf-config", str(BASE), "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_module_peft_left_out_of_a_fused_linear_adds_nothing(tmp_path):
    """q and v adapted, k not: linear_qkv's lora_B has k's rows zero, q's and v's PEFT's, by query group."""
    adapter = make_peft_adapter(tmp_path / "peft", ["q_proj", "v_proj"])
    from mconvert.formats.hf_checkpoint import read_hf_config
    from mconvert.mappings import get_mapping

    family, spec = get_mapping(read_hf_config(BASE, "--hf-config"))
    _, settings = adapters_in.read_peft_settings(adapter)
    (first, *_) = adapters_in.bridge_modules(adapters_in.read_peft_tensors(adapter), family, spec, settings, adapter)
    entry = next(e for e in family.table.layer(spec, 0).entries if e.mcore == "self_attention.linear_qkv.weight")
    q, k, v = entry.to_hf(first.lora_b, spec)
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    assert not np.any(k) and np.array_equal(q, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].numpy())
    assert np.array_equal(v, tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"].numpy())


def bridge_adapter_as_peft(site: str, base: str, adapter: str, config: dict) -> tuple[dict, dict]:
    """On each rank: the weight sync's PEFT tensors and config of Megatron-Bridge's model with the adapter."""
    from mconvert.converters.adapter_sync import gather_peft_adapter

    model, bridge_lora = bridge_model_with_adapter(site, base, adapter)
    return gather_peft_adapter(model, config, bridge_lora, base_name=str(BASE))


@needs_bridge
@pytest.mark.parametrize("tp", [1, 2])
def test_the_weight_sync_gives_adapter_to_hfs_tensors(tp, tmp_path):
    """Megatron-Bridge's own adapter save (the fixture's, made at this TP), loaded into its LoRA-wrapped model on TP
    ranks: the weight sync's PEFT tensors and config are adapter-to-hf's of the same save."""
    from mconvert.verify.distributed import run_ranks

    save = BASE.parent / f"tp{tp}" / "checkpoint"
    config = json.loads((BASE / "config.json").read_text())
    tensors, peft_config = run_ranks(
        bridge_adapter_as_peft, BRIDGE, str(base_checkpoint(tmp_path, tp)), str(save / "iter_0000010"), config, tp=tp, timeout_s=300
    )
    assert main(["adapter-to-hf", "--load-dir", str(save), "--hf-config", str(BASE), "--save-dir", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / ADAPTER_WEIGHTS)
    assert sorted(tensors) == sorted(exported) and all(torch.equal(tensors[n], exported[n]) for n in exported)
    assert peft_config == json.loads((tmp_path / "hf" / ADAPTER_CONFIG).read_text())


def test_an_moe_models_attention_adapter_goes_in_and_its_shared_experts_are_refused(tmp_path, capsys):
    """Qwen2-MoE (routed experts and a shared expert): LoRA on the attention goes in and comes back as it was;
    LoRA on the shared expert, whose Megatron-Bridge target name would wrap the routed experts too, is refused."""
    from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

    base = make_hf_checkpoint(shrink(real_config("qwen1.5-moe-a2.7b"), vocab_size=256), tmp_path / "hf", weight_std=0.1)
    make_peft_adapter(tmp_path / "attention", ["q_proj", "k_proj", "v_proj", "o_proj"], base=base, r=4)
    make_peft_adapter(tmp_path / "shared", ["q_proj", "shared_expert.gate_proj"], base=base, r=4)
    capsys.readouterr()
    flags = ["--hf-config", str(base), "--save-dir"]
    attention = to_mcore(tmp_path / "attention", tmp_path / "mcore", base=base)
    if HAVE_BRIDGE:  # Megatron-Bridge wraps the attention alone of the MoE model, and gives peft's logits
        assert max(bridge_errors(tmp_path, 1, {"attention": (tmp_path / "attention", attention)}, base).values()) < LOGITS_TOLERANCE
    assert main(["adapter-to-hf", "--load-dir", str(tmp_path / "mcore"), *flags, str(tmp_path / "back")]) == 0
    original, back = load_file(tmp_path / "attention" / ADAPTER_WEIGHTS), load_file(tmp_path / "back" / ADAPTER_WEIGHTS)
    assert sorted(original) == sorted(back) and all(torch.equal(original[n], back[n]) for n in original)
    capsys.readouterr()
    assert main(["adapter-to-mcore", "--adapter", str(tmp_path / "shared"), *flags, str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "'model.layers.0.mlp.shared_expert.gate_proj' has an adapter: adapters on an MoE layer's shared experts are not written yet" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()
