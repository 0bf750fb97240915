"""Qwen2 and Qwen2.5: Llama naming with biases on q, k and v (and only there)."""

from __future__ import annotations

from typing import Any

from mconvert.mappings import llama
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config


def read_config(config: dict[str, Any]) -> ModelSpec:
    return read_dense_spec(config, "qwen2", qkv_bias=True, linear_bias=False)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    return write_dense_config(spec, "qwen2", "Qwen2ForCausalLM")


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    model_sizes=("qwen2.5", "qwen2"),
    table=llama.TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen2ForCausalLM", "qwen2"),),
)
