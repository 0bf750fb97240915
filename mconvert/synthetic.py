"""Random-init HF checkpoints from real configs, shrunk: the test models, the demo and the benchmarks.

There is no network: models are made from config.json files (the real ones ship in `mconvert/configs/`) by
transformers itself, so the checkpoint layout is exactly what transformers writes.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

CONFIGS = ("llama-2-7b", "llama-3.1-8b", "qwen2.5-7b-instruct", "qwen3-8b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b-v0.1")


def real_config(name: str) -> dict[str, Any]:
    """A real model's config.json, as published (see mconvert/configs/)."""
    return json.loads(resources.files("mconvert").joinpath("configs", f"{name}.json").read_text())


def shrink(config: dict[str, Any], layers: int = 2, **overrides: Any) -> dict[str, Any]:
    """The same architecture at test size, keeping what distinguishes it: GQA or MHA, a head_dim that differs
    from hidden/heads, biases, rope settings, MoE with shared experts and dense layers mixed in."""
    small = dict(config)
    heads = 4
    grouped = config.get("num_key_value_heads", config["num_attention_heads"]) < config["num_attention_heads"]
    small.update(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=heads,
        num_key_value_heads=2 if grouped else heads,
        intermediate_size=128,
        vocab_size=1000,
        bos_token_id=1,
        eos_token_id=2,
    )
    if "head_dim" in config and config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        small["head_dim"] = 32  # hidden/heads is 16: keeps the two different, as in Qwen3
    elif "head_dim" in config:
        small["head_dim"] = 16
    experts_key = next((k for k in ("num_experts", "num_local_experts") if k in config), None)
    if experts_key:
        small[experts_key] = 8
        small["num_experts_per_tok"] = 2
    if "moe_intermediate_size" in config:
        small["moe_intermediate_size"] = 32
    if config.get("shared_expert_intermediate_size"):
        small["shared_expert_intermediate_size"] = 96
    small.update(overrides)
    return small


def make_hf_checkpoint(
    config: dict[str, Any],
    out_dir: str | os.PathLike,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str = "float32",
    fused_experts: bool = False,
) -> Path:
    """A random-init model of `config` saved by transformers' `save_pretrained` (several shards when
    `max_shard_size` is small). MoE experts are saved one tensor per expert as on the hub, or with
    `fused_experts` in the layout transformers v5 holds in memory (3-D tensors of all experts)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():
        for parameter in model.parameters():
            # Norm weights of ones and zero biases would hide mistakes in their mapping.
            parameter.normal_(0.0, 0.05 if parameter.dim() > 1 else 0.5).add_(1.0 if parameter.dim() == 1 else 0.0)
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, save_original_format=not fused_experts, **kwargs)
    return out_dir
