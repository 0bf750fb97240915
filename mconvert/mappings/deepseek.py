"""DeepSeek-V2, V2-Lite, V3 (and R1, Kimi-K2 shapes), GLM-4.7-Flash: multi-latent attention, dense layers first
(`first_k_dense_replace`), then routed experts with shared experts. V3 routes by sigmoid scores with a
per-expert bias that only chooses experts and group-limited choice; V2 by softmax, greedy. GLM-4.7-Flash
(`glm4_moe_lite`) is V3's model under config rules of its own: always sigmoid routing (it reads no `scoring_func`),
its experts where `mlp_layer_types` says (it reads no `first_k_dense_replace`).

Megatron-Core's MLA keeps HF's layouts: q_b_proj's per-head [no-rope; rope] rows, kv_a_proj_with_mqa's
[latent; rope] rows and kv_b_proj's per-head [key; value] rows are its linear_q_up_proj, linear_kv_down_proj
and linear_kv_up_proj as they are, and its rope de-interleaves pairs as DeepSeek's does (`rope_interleave`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings import llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.rope import partial_rotary_factor
from mconvert.mappings.spec import MLASpec, ModelSpec, MoESpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import Column, Replicated, Row, Vocabulary
from mconvert.mappings.transforms import Concat, Rename

# transformers' latent norms (q_a_layernorm, kv_a_layernorm) have a fixed epsilon whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def _query_rows(spec: ModelSpec) -> int:
    """Every head's query: its part without rope, then its rope part."""
    return spec.num_attention_heads * (spec.mla.qk_head_dim + spec.mla.qk_pos_emb_head_dim)


def _kv_latent_rows(spec: ModelSpec) -> int:
    """The compressed latent, then the rope part of the key that all heads share."""
    return spec.mla.kv_lora_rank + spec.mla.qk_pos_emb_head_dim


def _kv_rows(spec: ModelSpec) -> int:
    """Every head's key without rope, then its value."""
    return spec.num_attention_heads * (spec.mla.qk_head_dim + spec.mla.v_head_dim)


def _value_width(spec: ModelSpec) -> int:
    return spec.num_attention_heads * spec.mla.v_head_dim


def twice_hidden(spec: ModelSpec) -> int:
    """eh_proj's input: the embedding's norm and the hidden state's side by side."""
    return 2 * spec.hidden_size


# The latent norms are fused into the up projections under the Transformer Engine spec; mcore/layout.py
# writes them under the local spec's names (q_layernorm, kv_layernorm) too. The down projections are whole on
# every TP rank (Transformer Engine's duplicated linears); the up projections split whole heads; linear_proj
# splits its input.
MLA_ATTENTION = (
    Rename("input_layernorm.weight", "input_layernorm.weight", split=Replicated("hidden_size")),
    Rename(
        "self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", when="q_low_rank",
        split=Replicated("mla.q_lora_rank", "hidden_size"),
    ),
    Rename(
        "self_attention.linear_q_up_proj.layer_norm_weight", "self_attn.q_a_layernorm.weight", when="q_low_rank",
        split=Replicated("mla.q_lora_rank"),
    ),
    Rename(
        "self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", when="q_low_rank",
        split=Column(_query_rows, "mla.q_lora_rank"),
    ),
    Rename("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", when="q_full_rank", split=Column(_query_rows, "hidden_size")),
    Rename("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", split=Replicated(_kv_latent_rows, "hidden_size")),
    Rename("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attn.kv_a_layernorm.weight", split=Replicated("mla.kv_lora_rank")),
    Rename("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", split=Column(_kv_rows, "mla.kv_lora_rank")),
    Rename("self_attention.linear_proj.weight", "self_attn.o_proj.weight", split=Row("hidden_size", _value_width)),
)

# The router's expert bias: one per expert, whole on every rank, fp32 whatever the weights' dtype (Megatron keeps it
# so, as transformers keeps e_score_correction_bias: bf16 steps are coarser than its updates).
EXPERT_BIAS = Replicated("moe.num_experts", dtype=dtypes.float32)

# The router (with V3's expert bias) and the shared experts: one MLP of n_shared_experts x the experts' width.
MOE_MLP = (
    *qwen2_moe.ROUTER,
    Rename("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", when="router_expert_bias", split=EXPERT_BIAS),
    Concat(
        "mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        split=qwen2_moe.SHARED_FC1,
    ),
    Rename("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", split=qwen2_moe.SHARED_FC2),
)

# A multi-token prediction layer's own tensors: eh_proj takes [embedding norm; hidden norm] as Megatron does, its
# output split across TP ranks.
MTP = (
    Rename("enorm.weight", "enorm.weight", split=Replicated("hidden_size")),
    Rename("hnorm.weight", "hnorm.weight", split=Replicated("hidden_size")),
    Rename("eh_proj.weight", "eh_proj.weight", split=Column("hidden_size", twice_hidden)),
    Rename("final_layernorm.weight", "shared_head.norm.weight", split=Replicated("hidden_size")),
)
# Megatron's MTP layers use the model's embedding and output layer; the hub stores copies in each.
MTP_COPIES = (
    Rename("embedding.word_embeddings.weight", "embed_tokens.weight", split=Vocabulary()),
    Rename("output_layer.weight", "shared_head.head.weight", split=Vocabulary()),
)

TABLE = Table(
    model=llama.MODEL,
    attention=MLA_ATTENTION,
    mtp=MTP,
    mtp_copies=MTP_COPIES,
    mtp_count_field="num_nextn_predict_layers",
    dense_mlp=llama.DENSE_MLP,
    moe_mlp=MOE_MLP,
    experts=qwen2_moe.EXPERTS,
    fused_experts=qwen2_moe.FUSED_EXPERTS,
)


def first_dense_layers(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Layers from `first_k_dense_replace` on have experts (transformers ignores `moe_layer_freq`)."""
    dense = config.get("first_k_dense_replace") or 0
    if dense >= num_layers:
        raise ConversionError(f"{source}: no layer has experts (first_k_dense_replace={dense}, {num_layers} layers)")
    return tuple(layer >= dense for layer in range(num_layers))


def mlp_layer_types(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Layers whose `mlp_layer_types` entry is "sparse" have experts, "dense" a dense MLP (GLM-4.7-Flash's and Hy3's
    transformers classes, which read no `first_k_dense_replace`); without the field, the first layer is dense."""
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        kinds = ["dense"] + ["sparse"] * (num_layers - 1)
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ConversionError(f"{source}: mlp_layer_types {kinds!r} is not 'dense' or 'sparse' for each of the {num_layers} layers")
    if "sparse" not in kinds:
        raise ConversionError(f"{source}: no layer has experts (mlp_layer_types has no 'sparse' layer)")
    return tuple(kind == "sparse" for kind in kinds)


def dense_first(moe_layers: tuple[bool, ...]) -> bool:
    """Whether the layers with experts are all those after the first dense ones (`first_k_dense_replace` says which)."""
    return True in moe_layers and moe_layers == tuple(layer >= moe_layers.index(True) for layer in range(len(moe_layers)))


def write_mlp_layer_types(config: dict[str, Any], moe_layers: tuple[bool, ...]) -> dict[str, Any]:
    """`mlp_layer_types` of `moe_layers`, and `first_k_dense_replace` beside it where the dense layers are the first
    ones (the hub configs hold it, and other loaders read it); any other pattern has none."""
    config["mlp_layer_types"] = ["sparse" if is_moe else "dense" for is_moe in moe_layers]
    config.pop("first_k_dense_replace", None)
    if dense_first(moe_layers):
        config["first_k_dense_replace"] = moe_layers.index(True)
    return config


def read_groups(config: dict[str, Any], num_experts: int, top_k: int, group_score_top: int, source: str):
    """(num_groups, group_topk) for Megatron, None when routing is not group-limited. Megatron scores a group
    by the sum of its best top_k / group_topk experts; transformers by the sum of its best `group_score_top`."""
    groups, chosen = config.get("n_group") or 1, config.get("topk_group") or 1
    if groups == 1 or chosen >= groups:
        return None, None
    if num_experts % groups:
        raise ConversionError(f"{source}: n_group {groups} does not divide the {num_experts} experts")
    if top_k // chosen != group_score_top:
        raise ConversionError(
            f"{source}: group-limited routing with num_experts_per_tok {top_k} and topk_group {chosen} scores "
            f"groups by their best {top_k // chosen} experts in Megatron but by their best {group_score_top} here"
        )
    return groups, chosen


def read_moe(
    config: dict[str, Any], num_layers: int, sigmoid: bool, source: str, moe_layers: tuple[bool, ...] | None = None
) -> MoESpec:
    """DeepSeek's experts; in the layers `moe_layers` marks where the family says so otherwise than by
    `first_k_dense_replace`."""
    num_experts = require(config, "n_routed_experts", source)
    top_k = require(config, "num_experts_per_tok", source)
    width = require(config, "moe_intermediate_size", source)
    scale = float(config.get("routed_scaling_factor") or 1.0)
    if sigmoid:
        # Megatron renormalises sigmoid top-k weights whenever k > 1, and never for k = 1.
        if not config.get("norm_topk_prob", True) or top_k == 1:
            raise ConversionError(
                f"{source}: sigmoid routing with norm_topk_prob {config.get('norm_topk_prob')} and "
                f"num_experts_per_tok {top_k} cannot be expressed in Megatron (it renormalises exactly when k > 1)"
            )
        groups = read_groups(config, num_experts, top_k, 2, source)
    else:
        method = config.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConversionError(f"{source}: topk_method '{method}' is not supported (greedy, group_limited_greedy are)")
        groups = read_groups(config, num_experts, top_k, 1, source) if method == "group_limited_greedy" else (None, None)
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=width,
        moe_layers=first_dense_layers(config, num_layers, source) if moe_layers is None else moe_layers,
        # V2: softmax over all experts, top-k, never renormalised (transformers ignores norm_topk_prob there).
        router_pre_softmax=not sigmoid,
        shared_expert_ffn_hidden_size=width * require(config, "n_shared_experts", source),
        score_function="sigmoid" if sigmoid else "softmax",
        expert_bias=sigmoid,
        topk_scaling_factor=None if scale == 1.0 else scale,
        num_groups=groups[0],
        group_topk=groups[1],
        router_fp32=True,
    )


def read_mla(config: dict[str, Any], source: str) -> MLASpec:
    if config.get("attention_bias"):
        raise ConversionError(f"{source}: multi-latent attention with attention_bias cannot be expressed in Megatron")
    if config.get("rope_interleave", True) is False:
        raise ConversionError(f"{source}: rope_interleave false is not supported (Megatron's MLA rope de-interleaves)")
    return MLASpec(
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=require(config, "kv_lora_rank", source),
        qk_head_dim=require(config, "qk_nope_head_dim", source),
        qk_pos_emb_head_dim=require(config, "qk_rope_head_dim", source),
        v_head_dim=require(config, "v_head_dim", source),
    )


def read_mla_model(
    config: dict[str, Any], family: str, sigmoid: bool, source: str, moe_layers: tuple[bool, ...] | None = None
) -> ModelSpec:
    """A DeepSeek-style model: multi-latent attention, dense layers first (or where `moe_layers` says), then routed
    and shared experts."""
    mla = read_mla(config, source)
    spec = read_dense_spec(
        config,
        family,
        source,
        head_dim=mla.qk_head_dim + mla.qk_pos_emb_head_dim,
        num_query_groups=require(config, "num_attention_heads", source),
        mla=mla,
    )
    computed_differently = ()
    if spec.norm_eps != LATENT_NORM_EPS:
        computed_differently = (
            f"transformers normalises the attention latents with epsilon {LATENT_NORM_EPS:g} and the rest with "
            f"rms_norm_eps {spec.norm_eps:g}; megatron-core has one epsilon for every norm ({spec.norm_eps:g})",
        )
    moe = read_moe(config, spec.num_layers, sigmoid, source, moe_layers)
    return dataclasses.replace(spec, moe=moe, computed_differently=computed_differently)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    model_type = FAMILY.hf_model_type(config)
    if model_type != "glm4_moe_lite":
        return read_mla_model(config, "deepseek", model_type == "deepseek_v3", source)
    # GLM-4.7-Flash: its rope spans head_dim (qk_rope_head_dim) times partial_rotary_factor.
    if (factor := partial_rotary_factor(config)) != 1.0:
        raise ConversionError(f"{source}: partial_rotary_factor {factor} (rope on part of the rope dims) cannot be expressed in Megatron's MLA")
    moe_layers = mlp_layer_types(config, require(config, "num_hidden_layers", source), source)
    return read_mla_model(config, "deepseek", True, source, moe_layers)


def write_moe(config: dict[str, Any], spec: ModelSpec, family: str, layer_types: bool = False) -> dict[str, Any]:
    """The MoE fields of `config` (shared by GLM-4.5), or an error where `spec`'s experts differ from
    DeepSeek's: all layers after the first dense ones have experts (any layers, where the family's config says which
    layer by layer: `layer_types`), and ungated shared experts as wide as a whole number of experts."""
    moe = spec.moe
    if moe is None or True not in moe.moe_layers or not layer_types and not dense_first(moe.moe_layers):
        raise ConversionError(f"the {family} family has experts in all layers after the first dense ones")
    shared = moe.shared_expert_ffn_hidden_size
    if not shared or shared % moe.ffn_hidden_size or moe.shared_expert_gate:
        raise ConversionError(f"the {family} family has ungated shared experts as wide as a whole number of experts")
    for name in ("num_experts", "num_local_experts"):
        config.pop(name, None)
    config.update(
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.ffn_hidden_size,
        n_shared_experts=shared // moe.ffn_hidden_size,
        first_k_dense_replace=moe.moe_layers.index(True),
        routed_scaling_factor=moe.topk_scaling_factor or 1.0,
        n_group=moe.num_groups or 1,
        topk_group=moe.group_topk or 1,
        norm_topk_prob=moe.score_function == "sigmoid",
    )
    return write_mlp_layer_types(config, moe.moe_layers) if layer_types else config


def write_config(spec: ModelSpec) -> dict[str, Any]:
    mla = spec.mla
    if mla is None or spec.linear_bias or spec.qkv_bias or spec.qk_norm:
        raise ConversionError("the deepseek family has multi-latent attention without biases or q/k norms")
    sigmoid = spec.moe is not None and spec.moe.score_function == "sigmoid"
    # GLM-4.7-Flash's config also says where experts are when they are not all after the first dense layers.
    lite = FAMILY.hf_model_type(spec.hf_config) == "glm4_moe_lite" or sigmoid and not dense_first(spec.moe.moe_layers)
    if lite and not sigmoid:
        raise ConversionError("GLM-4.7-Flash (glm4_moe_lite) routes by sigmoid scores")
    model_type, architecture = (
        ("glm4_moe_lite", "Glm4MoeLiteForCausalLM") if lite
        else ("deepseek_v3", "DeepseekV3ForCausalLM") if sigmoid
        else ("deepseek_v2", "DeepseekV2ForCausalLM")
    )
    config = write_moe(write_dense_config(spec, model_type, architecture), spec, "deepseek", layer_types=lite)
    for name in ("head_dim", "qk_head_dim"):
        config.pop(name, None)
    config.update(
        attention_bias=False,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_head_dim,
        qk_rope_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        num_nextn_predict_layers=spec.mtp_layers,
    )
    if not lite:  # DeepSeek's own fields, which GLM-4.7-Flash's config has no use for
        config.update(
            moe_layer_freq=1,
            scoring_func=spec.moe.score_function,
            topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if spec.moe.num_groups else "greedy",
        )
    return config


FAMILY = Family(
    name="deepseek",
    model_types=("deepseek_v2", "deepseek_v3", "glm4_moe_lite"),
    model_sizes=("deepseek", "kimi-k2", "moonlight", "glm-4.7-flash", "glm4.7-flash", "glm4-moe-lite"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(
        ("DeepseekV2ForCausalLM", "deepseek_v2"), ("DeepseekV3ForCausalLM", "deepseek_v3"), ("Glm4MoeLiteForCausalLM", "glm4_moe_lite"),
    ),
)
