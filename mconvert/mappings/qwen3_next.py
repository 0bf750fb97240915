"""Qwen3-Next: three of every four layers gated delta-net linear attention, the fourth full attention whose
output is gated per head dimension; every layer MoE with a gated shared expert (but `mlp_only_layers`);
zero-centred RMSNorms (HF multiplies by 1 + w, as Megatron's `--apply-layernorm-1p`); partial rope.

Its gated delta-net fuses q, k, v and z into `in_proj_qkvz`, and b and a into `in_proj_ba`, grouped per key
head: for each key head, its query and key rows, then the value and z rows of the value heads that read it.
The convolution runs over the flat [q; k; v] channels. Megatron-Core stores each of these sections under a
key of its own (in_proj.weight.query, ...), every head in order: each is one Section of the HF tensor. The
delta-net's output norm is a plain RMSNorm in HF (weight w), but zero-centred like every norm in Megatron
(weight w - 1)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek, llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.rope import partial_rotary_factor
from mconvert.mappings.spec import LinearAttentionSpec, ModelSpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import Column, Replicated, Row, Sectioned
from mconvert.mappings.transforms import Rename, Section, Shift


def _grouped_qkvz(spec: ModelSpec):
    la = spec.linear_attention
    per_key = la.value_heads // la.key_heads
    value = per_key * la.value_head_dim
    return la.key_heads, (("query", la.key_head_dim), ("key", la.key_head_dim), ("value", value), ("z", value))


def _grouped_ba(spec: ModelSpec):
    la = spec.linear_attention
    per_key = la.value_heads // la.key_heads
    return la.key_heads, (("beta", per_key), ("alpha", per_key))


def flat_qkv(spec: ModelSpec):
    la = spec.linear_attention
    return 1, (("query", la.key_dim), ("key", la.key_dim), ("value", la.value_dim))


def conv1d(hf: str) -> tuple[Section, ...]:
    return tuple(
        Section(f"self_attention.conv1d.weight.{name}", hf, sections=flat_qkv, section=name, split=Sectioned(1, "linear_attention.conv_kernel"))
        for name in ("query", "key", "value")
    )


# What every gated delta-net layer has beside its input projections (the Qwen3.5 naming too). megatron-core's
# GatedDeltaNet splits its heads across TP ranks: the sections of in_proj and conv1d by rows, A_log and dt_bias (one
# per value head), out_proj by its input; the output norm spans one head.
DELTA_NET_REST = (
    Rename("self_attention.in_proj.layer_norm_weight", "input_layernorm.weight", split=Replicated("hidden_size")),
    *conv1d("linear_attn.conv1d.weight"),
    Rename("self_attention.A_log", "linear_attn.A_log", split=Column("linear_attention.value_heads")),
    Rename("self_attention.dt_bias", "linear_attn.dt_bias", split=Column("linear_attention.value_heads")),
    Shift("self_attention.out_norm.weight", "linear_attn.norm.weight", by=1.0, split=Replicated("linear_attention.value_head_dim")),
    Rename("self_attention.out_proj.weight", "linear_attn.out_proj.weight", split=Row("hidden_size", "linear_attention.value_dim")),
)

LINEAR_ATTENTION = DELTA_NET_REST + tuple(
    Section(f"self_attention.in_proj.weight.{name}", hf, sections=sections, section=name, split=Sectioned("hidden_size"))
    for hf, sections, names in (
        ("linear_attn.in_proj_qkvz.weight", _grouped_qkvz, ("query", "key", "value", "z")),
        ("linear_attn.in_proj_ba.weight", _grouped_ba, ("beta", "alpha")),
    )
    for name in names
)

# The multi-token prediction layer, kept apart under `mtp.` (its decoder layer, full attention, under `mtp.layers.0.`):
# eh_proj takes [embedding norm; hidden norm], as Megatron's does; its norms are zero-centred as the model's.
MTP = (
    Rename("enorm.weight", "pre_fc_norm_embedding.weight", split=Replicated("hidden_size")),
    Rename("hnorm.weight", "pre_fc_norm_hidden.weight", split=Replicated("hidden_size")),
    Rename("eh_proj.weight", "fc.weight", split=Column("hidden_size", deepseek.twice_hidden)),
    Rename("final_layernorm.weight", "norm.weight", split=Replicated("hidden_size")),
)
# Megatron-LM 0.19.2's model builder builds no multi-token prediction block beside gated delta-net in GPTModel (its
# mtp_block_spec asks get_gpt_decoder_layer_specs, which refuses the attention variant); HybridModel does.
MTP_LEFT_OUT = "Megatron-LM 0.19.2 builds none beside gated delta-net in GPTModel; --model-class hybrid converts it"

TABLE = Table(
    model=llama.MODEL,
    attention=llama.ATTENTION,
    linear_attention=LINEAR_ATTENTION,
    dense_mlp=llama.DENSE_MLP,
    moe_mlp=qwen2_moe.ROUTER + qwen2_moe.SHARED_EXPERT,
    experts=qwen2_moe.EXPERTS,
    fused_experts=qwen2_moe.FUSED_EXPERTS,
    mtp=MTP,
    mtp_prefix="mtp.",
    mtp_left_out=MTP_LEFT_OUT,
    mtp_count_field="mtp_num_hidden_layers",
)


def linear_layers(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Which layers have linear attention, as transformers reads `layer_types` (or derives them from
    `full_attention_interval`: every interval-th layer full)."""
    kinds = config.get("layer_types")
    if kinds is None:
        interval = config.get("full_attention_interval", 4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ConversionError(f"{source}: layer_types {kinds} is not one of linear_attention or full_attention per layer")
    return tuple(kind == "linear_attention" for kind in kinds)


def read_linear_attention(config: dict[str, Any], spec: ModelSpec, source: str) -> ModelSpec:
    """The fields the gated delta-net families share, on top of the dense ones."""
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{source}: hidden_act '{config['hidden_act']}' is not supported (silu is)")
    la = LinearAttentionSpec(
        key_heads=require(config, "linear_num_key_heads", source),
        value_heads=require(config, "linear_num_value_heads", source),
        key_head_dim=require(config, "linear_key_head_dim", source),
        value_head_dim=require(config, "linear_value_head_dim", source),
        conv_kernel=require(config, "linear_conv_kernel_dim", source),
        layers=linear_layers(config, spec.num_layers, source),
    )
    if la.value_heads % la.key_heads:
        raise ConversionError(f"{source}: linear_num_value_heads {la.value_heads} is not a multiple of linear_num_key_heads {la.key_heads}")
    return dataclasses.replace(
        spec,
        linear_attention=la,
        attention_output_gate=True,
        zero_centered_norms=True,
        qk_norm=True,
        rotary_percent=partial_rotary_factor(config),
    )


def read_moe(config: dict[str, Any], spec: ModelSpec, source: str) -> ModelSpec:
    spec = qwen2_moe.read_qwen_moe(config, spec, source, shared_expert=True)
    # transformers routes in fp32 (a softmax over fp32 logits' probabilities), as Megatron's moe_router_dtype fp32.
    return dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, router_fp32=True))


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    spec = read_linear_attention(config, read_dense_spec(config, "qwen3_next", source), source)
    return read_moe(config, spec, source)


def check_linear_attention(spec: ModelSpec, family: str) -> None:
    if spec.linear_attention is None or not spec.attention_output_gate or not spec.zero_centered_norms or not spec.qk_norm or spec.linear_bias or spec.qkv_bias:
        raise ConversionError(
            f"the {family} family has gated delta-net layers beside gated full attention with q/k norms, "
            "zero-centred norms and no biases"
        )


def write_linear_attention(config: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    la = spec.linear_attention
    config.pop("full_attention_interval", None)
    config.update(
        linear_num_key_heads=la.key_heads,
        linear_num_value_heads=la.value_heads,
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_conv_kernel_dim=la.conv_kernel,
        layer_types=["linear_attention" if linear else "full_attention" for linear in la.layers],
        attention_bias=False,
    )
    return config


def write_config(spec: ModelSpec) -> dict[str, Any]:
    check_linear_attention(spec, "qwen3_next")
    moe = spec.moe
    if moe is None or not moe.shared_expert_gate or moe.router_pre_softmax:
        raise ConversionError("the qwen3_next family has experts with a gated shared expert, their top k renormalised")
    config = write_linear_attention(qwen2_moe.write_qwen_moe(write_dense_config(spec, "qwen3_next", "Qwen3NextForCausalLM"), spec), spec)
    config.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, partial_rotary_factor=spec.rotary_percent)
    return config


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    model_sizes=("qwen3-next",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen3NextForCausalLM", "qwen3_next"),),
)
