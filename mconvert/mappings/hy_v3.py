"""Hy3 (Tencent's Hy3-preview, `hy_v3`): GLM-4.5's features under tensor names of its own. Grouped-query attention
with RMSNorm on each query and key head (always), rope on every dim; a dense MLP where `mlp_layer_types` says
"dense" (the first layer, by default), elsewhere routed experts beside one shared MLP (`shared_mlp`), routed by
sigmoid scores with a bias that only chooses experts (`expert_bias`, beside the router, not in it), the top-k
weights always renormalised and scaled by `router_scaling_factor`, no groups. Its multi-token prediction layer is HF
layer `num_hidden_layers`: enorm, hnorm, eh_proj and final_layernorm beside a whole decoder layer, with no copies of
the embedding or the output head.

transformers v5 holds the MoE tensors under other names in memory (mlp.gate, mlp.e_score_correction_bias,
mlp.shared_experts, the experts fused), as it writes them with `save_original_format=False`: both are read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek, glm4_moe, llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.transforms import Rename

# transformers' defaults where they are not read_dense_spec's.
DEFAULTS = {"head_dim": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "router_scaling_factor": 2.826, "num_shared_experts": 1, "enable_moe_fp32_combine": True}
DEFAULT_THETA = 11_158_840.0


def _renamed(entries, renames: tuple[tuple[str, str], ...]):
    """`entries` (their Megatron names, their splits) with each rename applied to their HF names."""

    def renamed(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name

    return tuple(
        dataclasses.replace(entry, hf=renamed(entry.hf)) if isinstance(entry, Rename)
        else dataclasses.replace(entry, hf_names=tuple(map(renamed, entry.hf_names)))
        for entry in entries
    )


# transformers v5's names, beside its fused experts: DeepSeek's router and shared experts, the expert bias on the MoE
# block rather than in its gate.
FUSED_MOE_MLP = _renamed(deepseek.MOE_MLP, (("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),))
# The hub's: transformers' conversion mapping for hy_v3, the other way.
MOE_MLP = _renamed(
    FUSED_MOE_MLP,
    (("mlp.gate.weight", "mlp.router.gate.weight"), ("mlp.e_score_correction_bias", "mlp.expert_bias"), ("mlp.shared_experts.", "mlp.shared_mlp.")),
)
# The MTP layer's own tensors: DeepSeek's, its final norm named final_layernorm.
MTP = _renamed(deepseek.MTP, (("shared_head.norm.", "final_layernorm."),))

TABLE = Table(
    model=llama.MODEL,
    attention=llama.ATTENTION,
    dense_mlp=llama.DENSE_MLP,
    moe_mlp=MOE_MLP,
    experts=qwen2_moe.EXPERTS,
    fused_experts=qwen2_moe.FUSED_EXPERTS,
    fused_moe_mlp=FUSED_MOE_MLP,
    mtp=MTP,
    mtp_count_field="num_nextn_predict_layers",
)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ConversionError(
            f"{source}: attention_bias or mlp_bias: Hy3's experts have no biases, and Megatron puts biases on every linear "
            "layer or on none"
        )
    config = {**DEFAULTS, **config}
    spec = read_dense_spec(config, "hy_v3", source, DEFAULT_THETA, applies_sliding_window=False, qk_norm=True)
    spec = glm4_moe.refuse_yarn(spec, source)
    top_k = require(config, "num_experts_per_tok", source)
    if top_k == 1:
        raise ConversionError(
            f"{source}: num_experts_per_tok 1: Hy3 renormalises the top-k weights always, megatron-core only when k > 1"
        )
    width = require(config, "moe_intermediate_size", source)
    scale = float(config["router_scaling_factor"])
    moe = MoESpec(
        num_experts=require(config, "num_experts", source),
        top_k=top_k,
        ffn_hidden_size=width,
        moe_layers=deepseek.mlp_layer_types(config, spec.num_layers, source),
        router_pre_softmax=False,
        shared_expert_ffn_hidden_size=width * require(config, "num_shared_experts", source),
        score_function="sigmoid",
        expert_bias=True,
        topk_scaling_factor=None if scale == 1.0 else scale,
        router_fp32=True,
    )
    computed_differently = ()
    if config["enable_moe_fp32_combine"]:
        computed_differently = (
            "transformers adds the routed and the shared experts' outputs in fp32 (enable_moe_fp32_combine); megatron-core "
            "adds them in the model's dtype",
        )
    return dataclasses.replace(spec, moe=moe, computed_differently=computed_differently)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    if (
        moe is None or spec.mla is not None or spec.linear_bias or spec.qkv_bias or not spec.qk_norm
        or spec.rotary_percent != 1.0 or spec.sliding_window is not None or moe.score_function != "sigmoid"
        or not moe.expert_bias or moe.num_groups or moe.shared_expert_gate or not moe.shared_expert_ffn_hidden_size
        or moe.shared_expert_ffn_hidden_size % moe.ffn_hidden_size
    ):
        raise ConversionError(
            "the hy_v3 family has q/k norms, no biases, rope on every dim and no windows, and experts routed by sigmoid "
            "scores with an expert bias and no groups, beside ungated shared experts as wide as a whole number of experts"
        )
    config = write_dense_config(spec, "hy_v3", "HYV3ForCausalLM")
    config.pop("num_local_experts", None)
    config.update(
        attention_bias=False,
        mlp_bias=False,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.ffn_hidden_size,
        num_shared_experts=moe.shared_expert_ffn_hidden_size // moe.ffn_hidden_size,
        router_scaling_factor=moe.topk_scaling_factor or 1.0,
        num_nextn_predict_layers=spec.mtp_layers,
        # megatron-core adds the experts' outputs in the model's dtype.
        enable_moe_fp32_combine=spec.hf_config.get("enable_moe_fp32_combine", False),
    )
    return deepseek.write_mlp_layer_types(config, moe.moe_layers)


FAMILY = Family(
    name="hy_v3",
    model_types=("hy_v3",),
    model_sizes=("hy3", "hy-v3"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("HYV3ForCausalLM", "hy_v3"),),
)
