"""Qwen3: Llama naming with RMSNorm on each query and key head, and a head_dim of its own."""

from __future__ import annotations

from typing import Any

from mconvert.mappings import llama
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config


def read_config(config: dict[str, Any]) -> ModelSpec:
    return read_dense_spec(config, "qwen3", qk_norm=True)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    config = write_dense_config(spec, "qwen3", "Qwen3ForCausalLM")
    config.update(attention_bias=spec.linear_bias)
    return config


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    model_sizes=("qwen3",),
    table=llama.TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen3ForCausalLM", "qwen3"),),
)
