"""GLM-4.5 and GLM-4.5-Air (`glm4_moe`): grouped-query attention with biases on q, k and v only, optional
q/k norms, rope on part of each head, then DeepSeek-V3's MoE (dense layers first, sigmoid routing with an
expert bias, shared experts). dots.llm1 (`dots1`) is the same model under config rules of its own: Qwen3's
attention (q/k norms always; `attention_bias` on q, k, v and o), rope on every dim, windows as its
`layer_types` or `max_window_layers` say, no multi-token prediction layers."""

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


def refuse_yarn(spec: ModelSpec, source: str) -> ModelSpec:
    """`spec`, or an error where its rope is YaRN-scaled: GLM-4.5's rule, which dots.llm1 and Hy3 share (none of their
    releases scales its rope)."""
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "yarn":
        raise ConversionError(f"{source}: yarn rope scaling outside multi-latent attention is not supported")
    return spec


def dots1_windows(config: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, tuple[bool, ...] | None]:
    """dots.llm1's attention windows as transformers reads them: (the window, which layers have it where only some
    do). Its `layer_types` where given, else layer i windowed from `max_window_layers` on when `sliding_window` is
    set (transformers' defaults: 4096 and 62); `use_sliding_window`, which its configs carry, is not read."""
    window = config.get("sliding_window", 4096)
    kinds = config.get("layer_types")
    if kinds is None:
        first = config.get("max_window_layers", 62)
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ConversionError(f"{source}: layer_types {kinds!r} is not sliding_attention or full_attention for each of the {num_layers} layers")
    layers = tuple(kind == "sliding_attention" for kind in kinds)
    if window is None or not any(layers):
        return None, None
    return int(window), None if all(layers) else layers


def read_dots1(config: dict[str, Any], source: str) -> ModelSpec:
    if config.get("attention_bias"):
        raise ConversionError(
            f"{source}: attention_bias puts biases on q, k, v and o but not on the MLPs (dots1), which Megatron cannot express"
        )
    # Its MLPs never have biases, whatever `mlp_bias` says.
    spec = read_dense_spec(
        {**config, "mlp_bias": False}, "glm4_moe", source, applies_sliding_window=False, qk_norm=True, hf_config=dict(config)
    )
    window, layers = dots1_windows(config, spec.num_layers, source)
    # transformers' Dots1 leaves the top-k weights unnormalised unless norm_topk_prob says otherwise.
    moe = deepseek.read_moe({"norm_topk_prob": False, **config}, spec.num_layers, True, source)
    return dataclasses.replace(refuse_yarn(spec, source), moe=moe, sliding_window=window, sliding_layers=layers)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    if FAMILY.hf_model_type(config) == "dots1":
        return read_dots1(config, source)
    # attention_bias puts biases on q, k and v only (o_proj has none): read the rest as bias-free. transformers'
    # GLM-4.5 attends fully whatever `sliding_window` says.
    spec = read_dense_spec(
        {**config, "attention_bias": False},
        "glm4_moe",
        source,
        applies_sliding_window=False,
        qkv_bias=bool(config.get("attention_bias", False)),
        qk_norm=bool(config.get("use_qk_norm", False)),
        rotary_percent=partial_rotary_factor(config),
        hf_config=dict(config),
    )
    return dataclasses.replace(refuse_yarn(spec, source), moe=deepseek.read_moe(config, spec.num_layers, True, source))


def write_dots1(spec: ModelSpec) -> dict[str, Any]:
    if not spec.qk_norm or spec.qkv_bias or spec.linear_bias or spec.rotary_percent != 1.0 or spec.mtp_layers:
        raise ConversionError(
            "dots.llm1 (dots1) has q/k norms, no biases that Megatron can express, rope on every dim and no multi-token "
            "prediction layers"
        )
    config = deepseek.write_moe(write_dense_config(spec, "dots1", "Dots1ForCausalLM"), spec, "dots1")
    layers = spec.sliding_layers or (spec.sliding_window is not None,) * spec.num_layers
    for name in ("use_sliding_window", "max_window_layers", "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers"):
        config.pop(name, None)
    config.update(
        attention_bias=False,
        sliding_window=spec.sliding_window,
        layer_types=["sliding_attention" if windowed else "full_attention" for windowed in layers],
    )
    return config


def write_config(spec: ModelSpec) -> dict[str, Any]:
    # Windows: transformers' GLM-4.5 has none, dots1 does.
    if FAMILY.hf_model_type(spec.hf_config) == "dots1" or spec.sliding_window is not None:
        return write_dots1(spec)
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
    model_types=("glm4_moe", "dots1"),
    model_sizes=("glm-4.5", "glm4.5", "glm4-moe", "dots1", "dots.llm1", "dots-llm1"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Glm4MoeForCausalLM", "glm4_moe"), ("Dots1ForCausalLM", "dots1")),
)
