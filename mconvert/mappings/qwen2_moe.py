"""Qwen1.5-MoE and Qwen2-MoE: Qwen2 attention, routed experts plus one shared expert behind a sigmoid gate,
and dense layers where `mlp_only_layers` and `decoder_sparse_step` say so. Qwen3-MoE reuses its layout."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import GatedColumn, Replicated, Row
from mconvert.mappings.transforms import Concat, Rename

# The router and the post-attention norm, which Megatron keeps apart from the experts in MoE layers.
ROUTER = (
    Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", split=Replicated("hidden_size")),
    Rename("mlp.router.weight", "mlp.gate.weight", split=Replicated("moe.num_experts", "hidden_size")),
)

# The shared experts: one MLP beside the routed ones, split across the TP ranks as a dense MLP is.
SHARED_FC1 = GatedColumn("moe.shared_expert_ffn_hidden_size", "hidden_size")
SHARED_FC2 = Row("hidden_size", "moe.shared_expert_ffn_hidden_size")

SHARED_EXPERT = (
    Concat(
        "mlp.shared_experts.linear_fc1.weight", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        split=SHARED_FC1,
    ),
    Rename("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight", split=SHARED_FC2),
    Rename("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight", split=Replicated(1, "hidden_size")),
)

# One expert's fc1 and fc2, split across the expert tensor-parallel ranks (ETP) as a dense MLP's are across TP.
EXPERT_FC1 = GatedColumn("moe.ffn_hidden_size", "hidden_size")
EXPERT_FC2 = Row("hidden_size", "moe.ffn_hidden_size")

# One expert, as the hub checkpoints store it.
EXPERTS = (
    Concat("linear_fc1.weight", ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"), split=EXPERT_FC1),
    Rename("linear_fc2.weight", "mlp.experts.{expert}.down_proj.weight", split=EXPERT_FC2),
)

# One expert's slice of transformers v5's fused tensors: gate_up_proj [E, 2F, H] holds [gate; up] per expert,
# which is Megatron's fc1 as it is; down_proj [E, H, F].
FUSED_EXPERTS = (
    Rename("linear_fc1.weight", "mlp.experts.gate_up_proj[{expert}]", split=EXPERT_FC1),
    Rename("linear_fc2.weight", "mlp.experts.down_proj[{expert}]", split=EXPERT_FC2),
)

TABLE = Table(
    model=llama.MODEL,
    attention=llama.ATTENTION,
    dense_mlp=llama.DENSE_MLP,
    moe_mlp=ROUTER + SHARED_EXPERT,
    experts=EXPERTS,
    fused_experts=FUSED_EXPERTS,
)


def num_experts(config: dict[str, Any], source: str) -> int:
    # transformers v5 writes Qwen3-MoE's `num_experts` as `num_local_experts` (an attribute_map alias).
    if config.get("num_experts") is None and config.get("num_local_experts") is not None:
        return require(config, "num_local_experts", source)
    return require(config, "num_experts", source)


def sparse_layers(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Which layers have experts, as transformers' Qwen2-MoE/Qwen3-MoE decoder layers decide it."""
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    layers = tuple(layer not in dense and (layer + 1) % step == 0 for layer in range(num_layers))
    if not any(layers):
        raise ConversionError(
            f"{source}: no layer has experts (decoder_sparse_step={step}, mlp_only_layers={sorted(dense)})"
        )
    return layers


def read_qwen_moe(config: dict[str, Any], spec: ModelSpec, source: str, shared_expert: bool) -> ModelSpec:
    moe = MoESpec(
        num_experts=num_experts(config, source),
        top_k=require(config, "num_experts_per_tok", source),
        ffn_hidden_size=require(config, "moe_intermediate_size", source),
        moe_layers=sparse_layers(config, spec.num_layers, source),
        # norm_topk_prob=False: softmax over all experts, top-k, no renormalisation (transformers' default).
        router_pre_softmax=not config.get("norm_topk_prob", False),
        shared_expert_ffn_hidden_size=require(config, "shared_expert_intermediate_size", source) if shared_expert else None,
        shared_expert_gate=shared_expert,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
    )
    return dataclasses.replace(spec, moe=moe)


def write_qwen_moe(config: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    config.pop("num_local_experts", None)
    config.update(
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.ffn_hidden_size,
        norm_topk_prob=not moe.router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[layer for layer, is_moe in enumerate(moe.moe_layers) if not is_moe],
        router_aux_loss_coef=moe.aux_loss_coeff,
    )
    return config


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    # transformers v5 reads `qkv_bias` (default true); v4 and the hub configs always have the q, k, v biases.
    spec = read_dense_spec(config, "qwen2_moe", source, qkv_bias=bool(config.get("qkv_bias", True)), linear_bias=False)
    return read_qwen_moe(config, spec, source, shared_expert=True)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    if spec.linear_bias or not moe.shared_expert_ffn_hidden_size or not moe.shared_expert_gate:
        raise ConversionError(
            "qwen2_moe needs a gated shared expert and no linear biases beyond q, k, v: this model has "
            f"shared expert size {moe.shared_expert_ffn_hidden_size}, gate {moe.shared_expert_gate}, "
            f"linear biases {spec.linear_bias}"
        )
    config = write_qwen_moe(write_dense_config(spec, "qwen2_moe", "Qwen2MoeForCausalLM"), spec)
    config.update(qkv_bias=spec.qkv_bias, shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size)
    return config


FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    model_sizes=("qwen2-moe", "qwen1.5-moe"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen2MoeForCausalLM", "qwen2_moe"),),
)
