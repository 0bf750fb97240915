"""OLMoE (`olmoe`, transformers' OlmoeForCausalLM): Llama attention whose q and k are each RMS-normalised over all heads
of the layer together (`q_norm` [heads x head_dim], `k_norm` [key heads x head_dim]: MiniMax-M2's norms, mconvert's
layer spec through `--spec`), and experts of intermediate_size in every layer, routed by a softmax over all experts,
the top-k weights renormalised only with `norm_topk_prob` (Qwen2-MoE's router and experts, without a shared expert).

transformers sizes the norms by hidden_size / num_attention_heads, so a head_dim of its own is refused; so is
`clip_qkv` (a clamp of q, k and v that megatron-core has no setting for) and a `sliding_window`, which transformers'
OLMoE applies under flash attention only (its eager and sdpa masks are causal over the whole prompt).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama, minimax_m2, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, read_dense_spec, require, write_dense_config

TABLE = Table(
    model=llama.MODEL,
    attention=minimax_m2.ATTENTION,
    dense_mlp=(),
    moe_mlp=qwen2_moe.ROUTER,
    experts=qwen2_moe.EXPERTS,
    fused_experts=qwen2_moe.FUSED_EXPERTS,
)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    for field, why in (("clip_qkv", "megatron-core has no clamp of q, k and v"),
                       ("sliding_window", "transformers' OLMoE applies it under flash attention only")):
        if config.get(field) is not None:
            raise ConversionError(f"{source}: {field} {config[field]!r} cannot be converted: {why}")
    spec = read_dense_spec(
        config, "olmoe", source, applies_sliding_window=False, qk_norm=True, qk_norm_across_heads=True,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),  # OlmoeConfig's default
    )
    if spec.head_dim * spec.num_attention_heads != spec.hidden_size:
        raise ConversionError(
            f"{source}: head_dim {spec.head_dim}: transformers' OLMoE sizes its q/k norms by hidden_size / "
            f"num_attention_heads ({spec.hidden_size // spec.num_attention_heads})"
        )
    moe = MoESpec(
        num_experts=qwen2_moe.num_experts(config, source),
        top_k=require(config, "num_experts_per_tok", source),
        # OLMoE's experts are its MLPs: intermediate_size is theirs.
        ffn_hidden_size=spec.ffn_hidden_size,
        moe_layers=(True,) * spec.num_layers,
        # norm_topk_prob false: softmax over all experts, top-k, no renormalisation.
        router_pre_softmax=not config.get("norm_topk_prob", False),
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.01)),
    )
    return dataclasses.replace(spec, moe=moe)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    if (
        moe is None or not all(moe.moe_layers) or moe.score_function != "softmax" or moe.expert_bias
        or moe.shared_expert_ffn_hidden_size or moe.ffn_hidden_size != spec.ffn_hidden_size or moe.num_groups
        or moe.topk_scaling_factor is not None or spec.linear_bias or spec.qkv_bias or not spec.qk_norm_across_heads
    ):
        raise ConversionError(
            "olmoe has experts of intermediate_size in every layer, routed by softmax scores without a routing bias, "
            f"no shared expert, no biases and q/k norms across heads: this model differs ({moe})"
        )
    config = write_dense_config(spec, "olmoe", "OlmoeForCausalLM")
    config.pop("num_local_experts", None)
    config.update(
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=not moe.router_pre_softmax,
        router_aux_loss_coef=moe.aux_loss_coeff,
        attention_bias=False,
        clip_qkv=None,
    )
    return config


FAMILY = Family(
    name="olmoe",
    model_types=("olmoe",),
    model_sizes=("olmoe",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("OlmoeForCausalLM", "olmoe"),),
)
