"""Llama 2, Llama 3/3.1/3.2, Mistral, Yi: the Llama naming that Qwen2 and Qwen3 share."""

from __future__ import annotations

from typing import Any

from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config
from mconvert.mappings.splits import Column, GatedColumn, Replicated, Row, Vocabulary, attention_width
from mconvert.mappings.transforms import Concat, QKVInterleave, Rename

MODEL = (
    Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", split=Vocabulary()),
    Rename("decoder.final_layernorm.weight", "model.norm.weight", split=Replicated("hidden_size")),
    Rename("output_layer.weight", "lm_head.weight", when="untie_embeddings", split=Vocabulary()),
)

# Tensor parallelism splits the fused QKV by whole query groups (the rows of each group are together) and
# linear_proj by its input; each q/k norm spans one head.
ATTENTION = (
    Rename("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", split=Replicated("hidden_size")),
    QKVInterleave(
        "self_attention.linear_qkv.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        split=Column(QKVInterleave.fused_rows, "hidden_size"),
    ),
    QKVInterleave(
        "self_attention.linear_qkv.bias",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        when="qkv_bias",
        split=Column(QKVInterleave.fused_rows),
    ),
    Rename("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when="qk_norm", split=Replicated("head_dim")),
    Rename("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when="qk_norm", split=Replicated("head_dim")),
    Rename("self_attention.linear_proj.weight", "self_attn.o_proj.weight", split=Row("hidden_size", attention_width)),
    Rename("self_attention.linear_proj.bias", "self_attn.o_proj.bias", when="linear_bias", split=Replicated("hidden_size")),
)

DENSE_MLP = (
    Rename("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight", split=Replicated("hidden_size")),
    Concat("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), split=GatedColumn("ffn_hidden_size", "hidden_size")),
    Concat("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), when="linear_bias", split=GatedColumn("ffn_hidden_size")),
    Rename("mlp.linear_fc2.weight", "mlp.down_proj.weight", split=Row("hidden_size", "ffn_hidden_size")),
    Rename("mlp.linear_fc2.bias", "mlp.down_proj.bias", when="linear_bias", split=Replicated("hidden_size")),
)

TABLE = Table(model=MODEL, attention=ATTENTION, dense_mlp=DENSE_MLP)


def read_config(config: dict[str, Any]) -> ModelSpec:
    # transformers' Llama ignores `sliding_window`; Mistral applies it.
    return read_dense_spec(config, "llama", applies_sliding_window=config.get("model_type") == "mistral")


def write_config(spec: ModelSpec) -> dict[str, Any]:
    if spec.hf_config.get("model_type") == "mistral" or spec.sliding_window is not None:
        return write_dense_config(spec, "mistral", "MistralForCausalLM")
    config = write_dense_config(spec, "llama", "LlamaForCausalLM")
    config.update(attention_bias=spec.linear_bias, mlp_bias=spec.linear_bias)
    return config


FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral"),
    model_sizes=("llama", "mistral", "yi"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral")),
)
