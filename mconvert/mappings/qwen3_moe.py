"""Qwen3-MoE: Qwen3 attention (q/k norms) with Qwen2-MoE's routed experts, no shared expert."""

from __future__ import annotations

from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config

TABLE = Table(
    model=llama.MODEL,
    attention=llama.ATTENTION,
    dense_mlp=llama.DENSE_MLP,
    moe_mlp=qwen2_moe.ROUTER,
    experts=qwen2_moe.EXPERTS,
    fused_experts=qwen2_moe.FUSED_EXPERTS,
)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    spec = read_dense_spec(config, "qwen3_moe", source, qk_norm=True)
    return qwen2_moe.read_qwen_moe(config, spec, source, shared_expert=False)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    if spec.moe.shared_expert_ffn_hidden_size or not spec.qk_norm:
        raise ConversionError(
            f"qwen3_moe has q/k norms and no shared expert: this model has q/k norms {spec.qk_norm}, "
            f"shared expert size {spec.moe.shared_expert_ffn_hidden_size}"
        )
    config = qwen2_moe.write_qwen_moe(write_dense_config(spec, "qwen3_moe", "Qwen3MoeForCausalLM"), spec)
    config.update(attention_bias=spec.linear_bias)
    return config


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    model_sizes=("qwen3-moe",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen3MoeForCausalLM", "qwen3_moe"),),
)
