"""ERNIE 4.5 dense (`ernie4_5`, transformers' Ernie4_5ForCausalLM): Llama's layer and names, with rope rotating each
pair of neighbouring dims (2i, 2i+1) of a head, as megatron-core's `rotary_interleaved` does (so no rows move), and
`use_bias` for biases on every linear layer (q, k, v, o, gate, up, down) or on none.

Its config's defaults are not Llama's: tied embeddings, two key-value heads, head_dim 128 whatever the width,
rms_norm_eps 1e-5, rope theta 500000 and 131072 positions. Its attention has no window, whatever config.json says.
"""

from __future__ import annotations

from typing import Any

from mconvert.mappings import llama
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec, read_dense_spec, require, write_dense_config

# transformers' Ernie4_5Config defaults where config.json leaves a field out.
DEFAULTS = {"tie_word_embeddings": True, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072}
DEFAULT_ROPE_THETA = 500000.0

# What megatron-core's unfused rope computes otherwise than transformers (every conversion prints it).
FP32_ROPE = ("transformers rotates ERNIE 4.5's q and k in fp32 and casts them back; megatron-core's unfused rope "
             "(--no-rope-fusion, the local spec) rotates them in the weights' dtype, Transformer Engine's fused "
             "rope in fp32")


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    read = {**DEFAULTS, **config}
    bias = bool(read.get("use_bias", False))
    # head_dim null: the width over the heads (Ernie4_5Config.__post_init__).
    head_dim = read["head_dim"] or require(read, "hidden_size", source) // require(read, "num_attention_heads", source)
    return read_dense_spec(
        {**read, "attention_bias": bias, "mlp_bias": bias}, "ernie4_5", source, default_theta=DEFAULT_ROPE_THETA,
        applies_sliding_window=False, head_dim=head_dim, rotary_interleaved=True,
        computed_differently=(FP32_ROPE,),
        hf_config=dict(config),
    )


def write_config(spec: ModelSpec) -> dict[str, Any]:
    config = write_dense_config(spec, "ernie4_5", "Ernie4_5ForCausalLM")
    config.update(use_bias=spec.linear_bias)
    return config


FAMILY = Family(
    name="ernie4_5",
    model_types=("ernie4_5",),
    model_sizes=("ernie4.5", "ernie-4.5"),
    table=llama.TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Ernie4_5ForCausalLM", "ernie4_5"),),
)
