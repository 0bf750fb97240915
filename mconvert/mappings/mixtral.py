"""Mixtral: Mistral attention and a MoE block in every layer (`block_sparse_moe`, experts w1/w3/w2), with
top-k routing renormalised over the k chosen experts."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import Replicated
from mconvert.mappings.transforms import Concat, Rename

ROUTER = (
    Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", split=Replicated("hidden_size")),
    Rename("mlp.router.weight", "block_sparse_moe.gate.weight", split=Replicated("moe.num_experts", "hidden_size")),
)

EXPERTS = (
    Concat(
        "linear_fc1.weight", ("block_sparse_moe.experts.{expert}.w1.weight", "block_sparse_moe.experts.{expert}.w3.weight"),
        split=qwen2_moe.EXPERT_FC1,
    ),
    Rename("linear_fc2.weight", "block_sparse_moe.experts.{expert}.w2.weight", split=qwen2_moe.EXPERT_FC2),
)

TABLE = Table(
    model=llama.MODEL,
    attention=llama.ATTENTION,
    dense_mlp=(),
    moe_mlp=ROUTER,
    experts=EXPERTS,
    # transformers v5 renames `block_sparse_moe.` to `mlp.` when loading; its fused layout is Qwen2-MoE's.
    fused_experts=qwen2_moe.FUSED_EXPERTS,
    fused_moe_mlp=qwen2_moe.ROUTER,
)

# transformers' MixtralConfig.default_theta
DEFAULT_ROPE_THETA = 1e6


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    spec = read_dense_spec(config, "mixtral", source, default_theta=DEFAULT_ROPE_THETA)
    moe = MoESpec(
        num_experts=require(config, "num_local_experts", source),
        top_k=require(config, "num_experts_per_tok", source),
        # Mixtral's experts are its MLPs: intermediate_size is theirs.
        ffn_hidden_size=spec.ffn_hidden_size,
        moe_layers=(True,) * spec.num_layers,
        router_pre_softmax=False,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
    )
    return dataclasses.replace(spec, moe=moe)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    if (
        not all(moe.moe_layers)
        or moe.router_pre_softmax
        or moe.shared_expert_ffn_hidden_size
        or moe.ffn_hidden_size != spec.ffn_hidden_size
        or spec.linear_bias
        or spec.qk_norm
    ):
        raise ConversionError(
            "mixtral has experts in every layer, of the size of intermediate_size, top-k softmax routing, no "
            f"shared expert, no biases and no q/k norms: this model differs ({moe})"
        )
    config = write_dense_config(spec, "mixtral", "MixtralForCausalLM")
    config.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coeff)
    return config


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    model_sizes=("mixtral",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("MixtralForCausalLM", "mixtral"),),
)
