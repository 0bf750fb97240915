"""Dense families converted to torch_dist, checked by megatron-core: its own GPTModel (local spec, gloo CPU
ranks) loads the checkpoint at the target TP/PP, every parameter equals what the HF weights imply (computed
here independently of mconvert's mapping code), and its forward gives transformers' logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.verify.distributed import run_ranks
from mconvert.verify.megatron_side import forward_logits, gather_global_state, load_model

TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def megatron_view(ckpt_dir: str, tokens: torch.Tensor):
    """In each rank: load the checkpoint into megatron-core's model; rank 0 returns its logits and tensors."""
    args = read_args(iteration_dir(Path(ckpt_dir)))
    model = load_model(ckpt_dir, args, torch.float32, transformer_impl="local")
    return forward_logits(model, tokens), gather_global_state(model), model[0].rotary_pos_emb.inv_freq


def hf_state(hf_dir) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def expected_megatron_state(hf_dir, tp: int) -> dict[str, torch.Tensor]:
    """What megatron-core's checkpoint keys must hold, written out by hand from the HF tensors."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = hf_state(hf_dir)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    groups = config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    vocab = config["vocab_size"]
    padded = math.ceil(vocab / (128 * tp)) * 128 * tp

    def layer(name):
        return [hf[f"model.layers.{i}.{name}"] for i in range(layers)]

    def qkv(q, k, v):
        per_group = heads // groups
        blocks = []
        for g in range(groups):
            blocks += [q[g * per_group * d : (g + 1) * per_group * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
        return torch.cat(blocks)

    def pad(t):
        return torch.cat([t, torch.zeros(padded - vocab, t.shape[1])])

    out = {
        "embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.stack(layer("input_layernorm.weight")),
        "decoder.layers.self_attention.linear_qkv.weight": torch.stack(
            [qkv(*qkv_i) for qkv_i in zip(*(layer(f"self_attn.{p}_proj.weight") for p in "qkv"))]
        ),
        "decoder.layers.self_attention.linear_proj.weight": torch.stack(layer("self_attn.o_proj.weight")),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.stack(layer("post_attention_layernorm.weight")),
        "decoder.layers.mlp.linear_fc1.weight": torch.stack(
            [torch.cat(pair) for pair in zip(layer("mlp.gate_proj.weight"), layer("mlp.up_proj.weight"))]
        ),
        "decoder.layers.mlp.linear_fc2.weight": torch.stack(layer("mlp.down_proj.weight")),
    }
    if not config.get("tie_word_embeddings"):
        out["output_layer.weight"] = pad(hf["lm_head.weight"])
    if "model.layers.0.self_attn.q_proj.bias" in hf:
        out["decoder.layers.self_attention.linear_qkv.bias"] = torch.stack(
            [qkv(*qkv_i) for qkv_i in zip(*(layer(f"self_attn.{p}_proj.bias") for p in "qkv"))]
        )
    if "model.layers.0.self_attn.q_norm.weight" in hf:
        out["decoder.layers.self_attention.q_layernorm.weight"] = torch.stack(layer("self_attn.q_norm.weight"))
        out["decoder.layers.self_attention.k_layernorm.weight"] = torch.stack(layer("self_attn.k_norm.weight"))
    return out


def hf_logits_and_inv_freq(hf_dir, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits, model.model.rotary_emb.inv_freq


MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 5, "num_key_value_heads": 2}

CASES = {
    # name: (config, layers, config overrides, HF shard size, parallelism)
    "llama3.1-gqa-rope-scaling-tp2": ("llama-3.1-8b", 2, {}, None, Parallelism(tp=2)),
    "qwen2.5-bias-vocab-pad-tp2": ("qwen2.5-7b-instruct", 2, {}, None, Parallelism(tp=2)),
    "qwen3-head-dim-pp2": ("qwen3-8b", 4, {}, None, Parallelism(pp=2)),
    "qwen2.5-tied-pp2": ("qwen2.5-7b-instruct", 2, {"tie_word_embeddings": True}, None, Parallelism(pp=2)),
    "llama2-mha-multi-shard-tp1": ("llama-2-7b", 2, {}, "60KB", Parallelism()),
    # A window shorter than the prompts, so that the window itself moves the logits.
    "mistral-sliding-window-tp2": ("llama-2-7b", 2, MISTRAL, None, Parallelism(tp=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_megatron_loads_what_hf_holds(case, hf_model_factory, tmp_path):
    config_name, layers, overrides, shard_size, parallelism = CASES[case]
    hf_dir = hf_model_factory(config_name, layers=layers, max_shard_size=shard_size, **overrides)
    if shard_size:
        assert len(list(hf_dir.glob("*.safetensors"))) > 2
    ckpt = tmp_path / "mcore"
    convert_hf_to_mcore(hf_dir, ckpt, parallelism=parallelism)

    logits, state, inv_freq = run_ranks(megatron_view, str(ckpt), TOKENS, tp=parallelism.tp, pp=parallelism.pp)

    expected = expected_megatron_state(hf_dir, parallelism.tp)
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    reference, reference_inv_freq = hf_logits_and_inv_freq(hf_dir, TOKENS)
    torch.testing.assert_close(logits[..., :vocab], reference, rtol=1e-4, atol=1e-4)
    # Rope theta and scaling barely move the logits of a short sequence: compare the frequencies themselves.
    torch.testing.assert_close(inv_freq, reference_inv_freq, rtol=1e-6, atol=0)
