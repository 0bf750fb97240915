"""DeepSeek-V2/V3 (multi-latent attention, sigmoid routing with an expert bias, group-limited routing, shared
experts, yarn, multi-token prediction layers) and GLM-4.5 (partial rope, q/k/v biases, q/k norms) converted to torch_dist, checked by
megatron-core 0.16.1: its GPTModel (local spec, gloo CPU ranks) loads the checkpoint at TP=2 with EP=2 and at
PP=2 (the dense first layer on another stage than the MoE one); every parameter equals what the HF weights
imply (written out here from the HF tensors, independently of the mapping tables), every key megatron asks for
is in the checkpoint, and its forward gives transformers' logits. The expert bias is filled with values that
change which experts are chosen, so a dropped bias shows in the logits. In bf16, the router Megatron builds from
the stored args sends every token to the experts transformers' router sends it to."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import add_mtp_layers, make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from mconvert.verify.megatron_side import load_model
from tests.test_moe_megatron import TOKENS, hf_logits, megatron_view, stored_keys

# name: (config, config overrides, HF experts fused in 3-D tensors)
MODELS = {
    # q_lora_rank set, sigmoid routing with expert bias, 4 groups of which 2 are chosen, scaled weights.
    "deepseek-v3": ("deepseek-v3", {}, False),
    # q_lora_rank null, softmax greedy routing, yarn with mscale 0.707, fused experts.
    "deepseek-v2-lite": ("deepseek-v2-lite", {}, True),
    "glm-4.5-air-qk-norm": ("glm-4.5-air", {"use_qk_norm": True}, False),
}

LAYOUTS = {
    "tp2-ep2": Parallelism(tp=2, ep=2),
    "pp2": Parallelism(pp=2),
}


def expected_megatron_state(hf_dir, tp: int) -> dict[str, torch.Tensor]:
    """What megatron-core's local-spec keys must hold, written out by hand from the HF tensors."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(path))
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    experts, vocab = config["n_routed_experts"], config["vocab_size"]
    padded = math.ceil(vocab / (128 * tp)) * 128 * tp
    mla = "kv_lora_rank" in config

    def qkv(p, kind):
        groups, d = config["num_key_value_heads"], config["head_dim"]
        q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
        per_group, blocks = heads // groups, []
        for g in range(groups):
            blocks += [q[g * per_group * d : (g + 1) * per_group * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
        return torch.cat(blocks)

    out = {
        "embedding.word_embeddings.weight": torch.cat([hf["model.embed_tokens.weight"], torch.zeros(padded - vocab, config["hidden_size"])]),
        "output_layer.weight": torch.cat([hf["lm_head.weight"], torch.zeros(padded - vocab, config["hidden_size"])]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    mtp_layers = sum(name.endswith(".enorm.weight") for name in hf)
    for i in range(layers + mtp_layers):
        p = f"model.layers.{i}."
        # Multi-token prediction layers: their own tensors beside a decoder layer.
        m = f"decoder.layers.{i}." if i < layers else f"mtp.layers.{i - layers}.transformer_layer."
        if i >= layers:
            own = f"mtp.layers.{i - layers}."
            out[f"{own}enorm.weight"], out[f"{own}hnorm.weight"] = hf[f"{p}enorm.weight"], hf[f"{p}hnorm.weight"]
            out[f"{own}eh_proj.weight"] = hf[f"{p}eh_proj.weight"]
            out[f"{own}final_layernorm.weight"] = hf[f"{p}shared_head.norm.weight"]
        a = f"{p}self_attn."
        if mla:
            # The local spec's MLA layers keep their norms' module names (no key map).
            out[f"{m}input_layernorm.weight"] = hf[f"{p}input_layernorm.weight"]
            out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{p}post_attention_layernorm.weight"]
            if config.get("q_lora_rank"):
                out[f"{m}self_attention.linear_q_down_proj.weight"] = hf[f"{a}q_a_proj.weight"]
                out[f"{m}self_attention.q_layernorm.weight"] = hf[f"{a}q_a_layernorm.weight"]
                out[f"{m}self_attention.linear_q_up_proj.weight"] = hf[f"{a}q_b_proj.weight"]
            else:
                out[f"{m}self_attention.linear_q_proj.weight"] = hf[f"{a}q_proj.weight"]
            out[f"{m}self_attention.linear_kv_down_proj.weight"] = hf[f"{a}kv_a_proj_with_mqa.weight"]
            out[f"{m}self_attention.kv_layernorm.weight"] = hf[f"{a}kv_a_layernorm.weight"]
            out[f"{m}self_attention.linear_kv_up_proj.weight"] = hf[f"{a}kv_b_proj.weight"]
        else:
            out[f"{m}self_attention.linear_qkv.layer_norm_weight"] = hf[f"{p}input_layernorm.weight"]
            out[f"{m}mlp.linear_fc1.layer_norm_weight"] = hf[f"{p}post_attention_layernorm.weight"]
            out[f"{m}self_attention.linear_qkv.weight"] = qkv(p, "weight")
            out[f"{m}self_attention.linear_qkv.bias"] = qkv(p, "bias")
            if config.get("use_qk_norm"):
                out[f"{m}self_attention.q_layernorm.weight"] = hf[f"{a}q_norm.weight"]
                out[f"{m}self_attention.k_layernorm.weight"] = hf[f"{a}k_norm.weight"]
        out[f"{m}self_attention.linear_proj.weight"] = hf[f"{a}o_proj.weight"]
        if i < config["first_k_dense_replace"]:
            out[f"{m}mlp.linear_fc1.weight"] = torch.cat([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]])
            out[f"{m}mlp.linear_fc2.weight"] = hf[f"{p}mlp.down_proj.weight"]
            continue
        out[f"{m}mlp.router.weight"] = hf[f"{p}mlp.gate.weight"]
        if f"{p}mlp.gate.e_score_correction_bias" in hf:
            out[f"{m}mlp.router.expert_bias"] = hf[f"{p}mlp.gate.e_score_correction_bias"]
        if f"{p}mlp.experts.gate_up_proj" in hf:
            fc1, fc2 = hf[f"{p}mlp.experts.gate_up_proj"], hf[f"{p}mlp.experts.down_proj"]
        else:
            e = f"{p}mlp.experts."
            fc1 = torch.stack([torch.cat([hf[f"{e}{x}.gate_proj.weight"], hf[f"{e}{x}.up_proj.weight"]]) for x in range(experts)])
            fc2 = torch.stack([hf[f"{e}{x}.down_proj.weight"] for x in range(experts)])
        out[f"{m}mlp.experts.experts.linear_fc1.weight"], out[f"{m}mlp.experts.experts.linear_fc2.weight"] = fc1, fc2
        s = f"{p}mlp.shared_experts."
        out[f"{m}mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[f"{s}gate_proj.weight"], hf[f"{s}up_proj.weight"]])
        out[f"{m}mlp.shared_experts.linear_fc2.weight"] = hf[f"{s}down_proj.weight"]
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_hf")
    # The hub's multi-token prediction layers where the config names them (V3, GLM-4.5; not V2-Lite).
    return {
        name: add_mtp_layers(make_hf_checkpoint(shrink(real_config(config), layers=2, **overrides), root / name, fused_experts=fused))
        for name, (config, overrides, fused) in MODELS.items()
    }


def test_expert_bias_changes_the_choice(hf_models, tmp_path, monkeypatch):
    """The filled expert bias must matter: zeroing it changes transformers' logits, and a conversion that drops it
    (zeros in its place) moves megatron-core's away from transformers'."""
    import transformers

    from mconvert import mappings
    from mconvert.mappings import deepseek
    from tests.test_gpt_oss import Zeroed

    hf_dir = hf_models["deepseek-v3"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
        model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
        assert not torch.allclose(model(TOKENS).logits, logits, rtol=1e-4, atol=1e-4)
    moe_mlp = tuple(Zeroed(e.mcore, e.hf, split=e.split) if e.mcore == "mlp.router.expert_bias" else e for e in deepseek.TABLE.moe_mlp)
    family = dataclasses.replace(deepseek.FAMILY, table=dataclasses.replace(deepseek.TABLE, moe_mlp=moe_mlp))
    monkeypatch.setitem(mappings.FAMILIES, family.name, family)
    convert_hf_to_mcore(hf_dir, tmp_path / "mcore", parallelism=Parallelism())
    megatron, _, _ = run_ranks(megatron_view, {"model": str(tmp_path / "mcore")}, TOKENS)["model"]
    assert not torch.allclose(megatron[..., :1000], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_loads_what_hf_holds(layout, hf_models, tmp_path):
    parallelism = LAYOUTS[layout]
    ckpts = {}
    for name, hf_dir in hf_models.items():
        ckpts[name] = str(tmp_path / name)
        convert_hf_to_mcore(hf_dir, ckpts[name], parallelism=parallelism)

    views = run_ranks(megatron_view, ckpts, TOKENS, tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep)

    for name, hf_dir in hf_models.items():
        logits, state, asked = views[name]
        expected = expected_megatron_state(hf_dir, parallelism.tp)
        assert set(state) == set(expected), (name, set(state) ^ set(expected))
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (name, key)
        # Beyond what the local spec asks for, only the Transformer Engine spec's names of the same norms.
        written = stored_keys(ckpts[name])
        assert asked <= written, (name, asked - written)
        layer_prefix = re.compile(r"^(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.")
        extra = {layer_prefix.sub("", key) for key in written - asked if "_extra_state" not in key}
        te_names = {"pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"}
        if "deepseek" in name:
            te_names |= {"self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.layer_norm_weight"}
        assert extra and extra <= te_names, (name, extra)
        vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        torch.testing.assert_close(logits[..., :vocab], hf_logits(hf_dir, TOKENS), rtol=1e-4, atol=1e-4)


def megatron_routes(ckpt_dirs: dict[str, str], hidden: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each checkpoint's first MoE layer's router, as Megatron-LM builds it from the stored args, in bf16:
    the routing weights [tokens, experts] (zero where not chosen) and the choice."""
    routes = {}
    for name, ckpt_dir in ckpt_dirs.items():
        model = load_model(ckpt_dir, read_args(iteration_dir(Path(ckpt_dir))), torch.bfloat16, transformer_impl="local")
        with torch.no_grad():
            probs, chosen = model[0].decoder.layers[1].mlp.router(hidden.unsqueeze(1))
        routes[name] = probs.float(), chosen
    return routes


def test_megatron_routes_bf16_tokens_as_transformers_does(tmp_path):
    """transformers computes these families' router logits in fp32 whatever the model's dtype; in bf16,
    Megatron's router must too (`moe_router_dtype` fp32), or near-equal expert scores round to ties and tokens
    go to other experts than the HF model sends them to."""
    import transformers

    hidden = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    hf_dirs, ckpts = {}, {}
    for name, (config, overrides, fused) in MODELS.items():
        hf_dirs[name] = make_hf_checkpoint(shrink(real_config(config), layers=2, **overrides), tmp_path / name, dtype="bfloat16", fused_experts=fused)
        ckpts[name] = str(tmp_path / f"{name}-mcore")
        convert_hf_to_mcore(hf_dirs[name], ckpts[name])

    routes = run_ranks(megatron_routes, ckpts, hidden)

    for name, hf_dir in hf_dirs.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
        with torch.no_grad():
            _, weights, experts = model.model.layers[1].mlp.gate(hidden)
        expected = torch.zeros(len(hidden), routes[name][0].shape[1]).scatter(1, experts, weights.float())
        probs, chosen = routes[name]
        assert torch.equal(chosen, expected > 0), (name, (chosen != (expected > 0)).any(1).sum().item())
        torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)
