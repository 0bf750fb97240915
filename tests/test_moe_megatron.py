"""MoE families converted to torch_dist, checked by megatron-core: its GPTModel (local spec, SequentialMLP
experts, gloo CPU ranks) loads the checkpoint at EP=2, at TP=2 with expert TP, and at TP=2 with EP=2 and ETP=1;
every parameter equals what the HF weights imply (written out here independently of the mapping tables),
every key megatron asks for (tensors and `_extra_state` objects) is in the checkpoint, and its forward gives
transformers' logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.rank_export import model_sharded_state_dict
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from mconvert.verify.megatron_side import forward_logits, gather_global_state, load_model

TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))

# name: (config, layers, config overrides, HF experts fused in 3-D tensors)
MODELS = {
    "qwen3_moe-dense-layers-mixed-in": ("qwen3-30b-a3b", 4, {"mlp_only_layers": [0, 3]}, False),
    "qwen2_moe-shared-expert": ("qwen1.5-moe-a2.7b", 2, {}, False),
    "mixtral-fused-experts": ("mixtral-8x7b-v0.1", 2, {}, True),
}

LAYOUTS = {
    "ep2": Parallelism(ep=2),
    "tp2-etp2": Parallelism(tp=2, etp=2),
    "tp2-ep2-etp1": Parallelism(tp=2, ep=2, etp=1),
}


def megatron_view(ckpt_dirs: dict[str, str], tokens: torch.Tensor):
    """In each rank: load every checkpoint into megatron-core's model. Rank 0 returns, per checkpoint, the
    logits, the gathered tensors and the keys of every tensor and object the model asked for."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    views = {}
    for name, ckpt_dir in ckpt_dirs.items():
        args = read_args(iteration_dir(Path(ckpt_dir)))
        model = load_model(ckpt_dir, args, torch.float32, transformer_impl="local")
        sharded_state_dict = model_sharded_state_dict(model[0])
        apply_factories(sharded_state_dict)
        asked = {
            value.unique_key if isinstance(value, ShardedObject) else value.key
            for value in nested_values(sharded_state_dict)
            if isinstance(value, (ShardedObject, ShardedTensor))
        }
        all_asked = [None] * dist.get_world_size()
        dist.all_gather_object(all_asked, asked)
        views[name] = (forward_logits(model, tokens), gather_global_state(model), set().union(*all_asked))
    return views


def stored_keys(ckpt_dir) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(iteration_dir(Path(ckpt_dir)))).read_metadata().state_dict_metadata)


def expected_megatron_state(hf_dir, tp: int) -> dict[str, torch.Tensor]:
    """What megatron-core's (local spec) keys must hold, written out by hand from the HF tensors."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(path))
    layers, heads, groups = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    experts = config.get("num_experts") or config["num_local_experts"]
    vocab = config["vocab_size"]
    padded = math.ceil(vocab / (128 * tp)) * 128 * tp
    mixtral = config["model_type"] == "mixtral"

    def qkv(p, kind):
        q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
        per_group, blocks = heads // groups, []
        for g in range(groups):
            blocks += [q[g * per_group * d : (g + 1) * per_group * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
        return torch.cat(blocks)

    def expert_tensors(p):
        """[E, 2F, H] fc1 and [E, H, F] fc2 of all experts, from either HF layout."""
        if f"{p}mlp.experts.gate_up_proj" in hf:
            return hf[f"{p}mlp.experts.gate_up_proj"], hf[f"{p}mlp.experts.down_proj"]
        names = ("block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3", "block_sparse_moe.experts.{}.w2")
        if not mixtral:
            names = ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj")
        gate, up, down = ([hf[f"{p}{n.format(e)}.weight"] for e in range(experts)] for n in names)
        return torch.stack([torch.cat(pair) for pair in zip(gate, up)]), torch.stack(down)

    per_layer = []
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {
            "self_attention.linear_qkv.layer_norm_weight": hf[f"{p}input_layernorm.weight"],
            "self_attention.linear_qkv.weight": qkv(p, "weight"),
            "self_attention.linear_proj.weight": hf[f"{p}self_attn.o_proj.weight"],
            "mlp.linear_fc1.layer_norm_weight": hf[f"{p}post_attention_layernorm.weight"],
        }
        if f"{p}self_attn.q_proj.bias" in hf:
            t["self_attention.linear_qkv.bias"] = qkv(p, "bias")
        if f"{p}self_attn.q_norm.weight" in hf:
            t["self_attention.q_layernorm.weight"] = hf[f"{p}self_attn.q_norm.weight"]
            t["self_attention.k_layernorm.weight"] = hf[f"{p}self_attn.k_norm.weight"]
        router = next((hf[n] for n in (f"{p}mlp.gate.weight", f"{p}block_sparse_moe.gate.weight") if n in hf), None)
        if router is None:
            t["mlp.linear_fc1.weight"] = torch.cat([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]])
            t["mlp.linear_fc2.weight"] = hf[f"{p}mlp.down_proj.weight"]
        else:
            t["mlp.router.weight"] = router
            t["mlp.experts.experts.linear_fc1.weight"], t["mlp.experts.experts.linear_fc2.weight"] = expert_tensors(p)
            if f"{p}mlp.shared_expert_gate.weight" in hf:
                s = f"{p}mlp.shared_expert."
                t["mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[f"{s}gate_proj.weight"], hf[f"{s}up_proj.weight"]])
                t["mlp.shared_experts.linear_fc2.weight"] = hf[f"{s}down_proj.weight"]
                t["mlp.shared_experts.gate_weight"] = hf[f"{p}mlp.shared_expert_gate.weight"]
        per_layer.append(t)

    def pad(t):
        return torch.cat([t, torch.zeros(padded - vocab, t.shape[1])])

    out = {
        "embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"]),
        "output_layer.weight": pad(hf["lm_head.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if all(t.keys() == per_layer[0].keys() for t in per_layer):
        out.update({f"decoder.layers.{n}": torch.stack([t[n] for t in per_layer]) for n in per_layer[0]})
    else:
        out.update({f"decoder.layers.{i}.{n}": v for i, t in enumerate(per_layer) for n, v in t.items()})
    return out


def hf_logits(hf_dir, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    return {
        name: make_hf_checkpoint(shrink(real_config(config), layers=layers, **overrides), root / name, fused_experts=fused)
        for name, (config, layers, overrides, fused) in MODELS.items()
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_loads_what_hf_holds(layout, hf_models, tmp_path):
    parallelism = LAYOUTS[layout]
    ckpts = {}
    for name, hf_dir in hf_models.items():
        ckpts[name] = str(tmp_path / name)
        convert_hf_to_mcore(hf_dir, ckpts[name], parallelism=parallelism)

    views = run_ranks(megatron_view, ckpts, TOKENS, tp=parallelism.tp, ep=parallelism.ep, etp=parallelism.etp)

    for name, hf_dir in hf_models.items():
        logits, state, asked = views[name]
        expected = expected_megatron_state(hf_dir, parallelism.tp)
        assert set(state) == set(expected), name
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (name, key)
        # Beyond what the local spec asks for, only the Transformer Engine spec's name of the MoE norm.
        written = stored_keys(ckpts[name])
        assert asked <= written
        extra_tensors = {key for key in written - asked if "_extra_state" not in key}
        assert extra_tensors and all(key.endswith("pre_mlp_layernorm.weight") for key in extra_tensors), name
        vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        torch.testing.assert_close(logits[..., :vocab], hf_logits(hf_dir, TOKENS), rtol=1e-4, atol=1e-4)
