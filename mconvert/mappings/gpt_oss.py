"""gpt-oss (20B, 120B): attention with biases and a learned sink per head (Megatron's softmax_type
"learnable"), sliding-window layers alternating with full ones, YaRN without rounding its correction range,
and MoE layers whose router and experts have biases and whose experts' SwiGLU is clamped and offset.

transformers holds the experts fused: gate_up_proj [E, H, 2I], its gate and up columns alternating, and
down_proj [E, I, H], both [in, out] where Megatron's linear weights are [out, in]."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import Column, GatedColumn, Replicated
from mconvert.mappings.transforms import Deinterleave, Rename, Transpose

# The sinks: one logit per head, split across TP ranks as the heads are.
ATTENTION = llama.ATTENTION + (Rename("self_attention.core_attention.softmax_offset", "self_attn.sinks", split=Column("num_attention_heads")),)

ROUTER = (
    Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", split=Replicated("hidden_size")),
    Rename("mlp.router.weight", "mlp.router.weight", split=Replicated("moe.num_experts", "hidden_size")),
    Rename("mlp.router.bias", "mlp.router.bias", split=Replicated("moe.num_experts")),
)

# One expert's slices of the fused tensors.
FUSED_EXPERTS = (
    Deinterleave("linear_fc1.weight", "mlp.experts.gate_up_proj[{expert}]", transposed=True, split=qwen2_moe.EXPERT_FC1),
    Deinterleave("linear_fc1.bias", "mlp.experts.gate_up_proj_bias[{expert}]", split=GatedColumn("moe.ffn_hidden_size")),
    Transpose("linear_fc2.weight", "mlp.experts.down_proj[{expert}]", split=qwen2_moe.EXPERT_FC2),
    Rename("linear_fc2.bias", "mlp.experts.down_proj_bias[{expert}]", split=Replicated("hidden_size")),
)

TABLE = Table(model=llama.MODEL, attention=ATTENTION, dense_mlp=(), moe_mlp=ROUTER, fused_experts=FUSED_EXPERTS)

# transformers' gpt-oss: the experts' activation, fixed in its code but for the clamp (swiglu_limit).
QUICK_GELU_ALPHA = 1.702


def sliding_layers(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    kinds = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ConversionError(f"{source}: layer_types {kinds} is not one of sliding_attention or full_attention per layer")
    return tuple(kind == "sliding_attention" for kind in kinds)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    if not config.get("attention_bias", True):
        raise ConversionError(f"{source}: gpt-oss without attention_bias cannot be expressed in Megatron (its experts have biases)")
    if float(config.get("swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
        raise ConversionError(f"{source}: swiglu_alpha {config['swiglu_alpha']} cannot be expressed in Megatron (its quick_gelu has 1.702)")
    spec = read_dense_spec({**config, "mlp_bias": True}, "gpt_oss", source, applies_sliding_window=False)
    layers = sliding_layers(config, spec.num_layers, source)
    window = require(config, "sliding_window", source)
    moe = MoESpec(
        num_experts=require(config, "num_local_experts", source),
        top_k=require(config, "num_experts_per_tok", source),
        ffn_hidden_size=spec.ffn_hidden_size,
        moe_layers=(True,) * spec.num_layers,
        # Top-k of the router's logits, then a softmax over the k: Megatron's order without pre-softmax.
        router_pre_softmax=False,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
    )
    return dataclasses.replace(
        spec,
        moe=moe,
        sliding_window=int(window) if any(layers) else None,
        sliding_layers=layers if any(layers) and not all(layers) else None,
        softmax_type="learnable",
        activation="quick_gelu",
        glu_linear_offset=1.0,
        activation_clamp=float(config.get("swiglu_limit", 7.0)),
    )


def write_config(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    if (
        moe is None or not all(moe.moe_layers) or moe.shared_expert_ffn_hidden_size or moe.score_function != "softmax"
        or moe.router_pre_softmax or not spec.linear_bias or spec.softmax_type != "learnable" or spec.activation != "quick_gelu"
    ):
        raise ConversionError(
            "the gpt_oss family has experts in every layer routed by a softmax over the top k, biases, attention "
            "sinks and a quick-GELU gated MLP"
        )
    config = write_dense_config(spec, "gpt_oss", "GptOssForCausalLM")
    layers = spec.sliding_layers or (spec.sliding_window is not None,) * spec.num_layers
    for name in ("use_sliding_window", "mlp_bias", "num_experts", "experts_per_token"):
        config.pop(name, None)
    config.update(
        attention_bias=True,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coeff,
        sliding_window=spec.sliding_window or spec.hf_config.get("sliding_window", 128),
        layer_types=["sliding_attention" if windowed else "full_attention" for windowed in layers],
        swiglu_limit=spec.activation_clamp,
    )
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "yarn":
        config["rope_scaling"]["truncate"] = spec.rope_scaling.truncate
    return config


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    model_sizes=("gpt-oss",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("GptOssForCausalLM", "gpt_oss"),),
)
