"""GLM-4.5 and GLM-4.5-Air (`glm4_moe`): grouped-query attention with biases on q, k and v only, optional
q/k norms, rope on part of each head, then DeepSeek-V3's MoE (dense layers first, sigmoid routing with an
expert bias, shared experts)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek, llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.rope import partial_rotary_factor
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config

TABLE = Table(
    model=llama.MODEL,
    attention=llama.ATTENTION,
    dense_mlp=llama.DENSE_MLP,
    moe_mlp=deepseek.MOE_MLP,
    experts=qwen2_moe.EXPERTS,
    fused_experts=qwen2_moe.FUSED_EXPERTS,
    mtp=deepseek.MTP,
    mtp_copies=deepseek.MTP_COPIES,
    mtp_count_field="num_nextn_predict_layers",
)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    # attention_bias puts biases on q, k and v only (o_proj has none): read the rest as bias-free.
    spec = read_dense_spec(
        {**config, "attention_bias": False},
        "glm4_moe",
        source,
        qkv_bias=bool(config.get("attention_bias", False)),
        qk_norm=bool(config.get("use_qk_norm", False)),
        rotary_percent=partial_rotary_factor(config),
        hf_config=dict(config),
    )
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "yarn":
        raise ConversionError(f"{source}: yarn rope scaling outside multi-latent attention is not supported")
    return dataclasses.replace(spec, moe=deepseek.read_moe(config, spec.num_layers, True, source))


def write_config(spec: ModelSpec) -> dict[str, Any]:
    if spec.mla is not None or spec.linear_bias:
        raise ConversionError("the glm4_moe family has grouped-query attention with no biases beyond q, k, v")
    config = deepseek.write_moe(write_dense_config(spec, "glm4_moe", "Glm4MoeForCausalLM"), spec, "glm4_moe")
    config.update(
        attention_bias=spec.qkv_bias,
        use_qk_norm=spec.qk_norm,
        partial_rotary_factor=spec.rotary_percent,
        num_nextn_predict_layers=spec.mtp_layers,
    )
    return config


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    model_sizes=("glm-4.5", "glm4.5", "glm4-moe"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Glm4MoeForCausalLM", "glm4_moe"),),
)
