"""Gemma 3's text model (`gemma3_text`, transformers' Gemma3ForCausalLM) and the language model of its image-text
checkpoints (`gemma3`, Gemma3ForConditionalGeneration), whose vision tower and multi-modal projector a Megatron GPT
checkpoint does not hold.

A Gemma 3 layer has four norms: before and after its attention (`input_layernorm`, `post_attention_layernorm`) and
before and after its MLP (`pre_feedforward_layernorm`, `post_feedforward_layernorm`), every norm and the per-head q/k
norms multiplying by 1 + w (megatron-core's zero-centred gamma); its MLP is a GeGLU with GELU's tanh approximation;
its embeddings are multiplied by sqrt(hidden_size), its attention scores by 1/sqrt(query_pre_attn_scalar). The
layers `layer_types` marks attend within a window and rotate with a rope of their own (`rope_local_base_freq`,
unscaled), the others with the model's (`rope_theta`, and `rope_scaling`). megatron-core lacks the norms after the
sublayers, the GeGLU (as a Megatron-LM flag) and a rope per layer: they are mconvert's layer spec
(mconvert.megatron_lm.layer_specs.gpt_layers_of_gemma3). The two scales are megatron-core's MuP settings.

Its table is Llama's with the norm before the MLP named `pre_feedforward_layernorm` (Llama's `post_attention_layernorm`
is that norm; Gemma's is the one after the attention) and OLMo 2's two norms after the sublayers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import gpt_oss, llama, olmo2
from mconvert.mappings.family import Family, Table
from mconvert.mappings.rope import read_rope
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config
from mconvert.mappings.splits import Replicated
from mconvert.mappings.transforms import Rename

NORM_BEFORE_MLP = "mlp.linear_fc1.layer_norm_weight"
ATTENTION = (*llama.ATTENTION, olmo2.NORM_AFTER_ATTENTION)
DENSE_MLP = (
    Rename(NORM_BEFORE_MLP, "pre_feedforward_layernorm.weight", split=Replicated("hidden_size")),
    *(entry for entry in llama.DENSE_MLP if entry.mcore != NORM_BEFORE_MLP),
    olmo2.NORM_AFTER_MLP,
)
TEXT_TABLE = Table(model=llama.MODEL, attention=ATTENTION, dense_mlp=DENSE_MLP)

# The image-text checkpoints, as the hub holds them and transformers 5.24 saves them: the language model under
# `language_model.`, beside the vision tower and the projector of its image features into the text embeddings.
TABLE = TEXT_TABLE.under(
    "language_model.",
    left_out=(("vision_tower.", "the vision tower"), ("multi_modal_projector.", "the multi-modal projector")),
    copied_back=("vision_tower.", "multi_modal_projector."),
)

# transformers 5.24's Gemma3TextConfig where config.json says nothing (an image-text checkpoint's text_config says
# little: google/gemma-3-4b-it's names six fields).
DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}
# Gemma3TextConfig's rope theta of each layer type where the config names none, and its layers' pattern (every
# sixth layer attends fully) where it names no layer_types.
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
DEFAULT_PATTERN = 6
LAYER_TYPES = ("sliding_attention", "full_attention")


def rope_by_layer_type(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's rope parameters as transformers 5.24 reads them (Gemma3TextConfig.convert_rope_params_to_dict):
    `rope_parameters` by layer type, a hub config's `rope_scaling` added to the full-attention layers', `rope_theta`
    their theta and `rope_local_base_freq` the sliding-window layers' where theirs says none."""
    params = config.get("rope_parameters") or {}
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(config.get("rope_scaling") or {})}
    full.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA["full_attention"]))
    sliding = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    sliding.setdefault("rope_theta", config.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"]))
    return {"full_attention": full, "sliding_attention": sliding}


def read_text_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    config = {**DEFAULTS, **config}
    for field, what in (("final_logit_softcapping", "final logit softcapping"), ("attn_logit_softcapping", "attention logit softcapping")):
        if config.get(field) is not None:
            raise ConversionError(f"{source}: Gemma 3 with {what} ({field} {config[field]}) cannot be converted: megatron-core 0.19.2 has no logit softcapping")
    if config.get("use_bidirectional_attention"):
        raise ConversionError(f"{source}: Gemma 3 with use_bidirectional_attention cannot be converted: megatron-core's GPT layers attend causally")
    if config["hidden_activation"] != "gelu_pytorch_tanh":
        raise ConversionError(f"{source}: hidden_activation '{config['hidden_activation']}' is not supported (gelu_pytorch_tanh is)")
    layers = config["num_hidden_layers"]
    pattern = config.get("sliding_window_pattern", DEFAULT_PATTERN)
    kinds = config.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    sliding = gpt_oss.sliding_layers({"layer_types": kinds}, layers, source)
    if any(sliding) and config["sliding_window"] is None:
        raise ConversionError(f"{source}: sliding_attention layers with sliding_window null")
    ropes = {kind: read_rope({"rope_parameters": rope}, source) for kind, rope in rope_by_layer_type(config).items()}
    theta, scaling = ropes["full_attention"]
    sliding_theta, sliding_scaling = ropes["sliding_attention"]
    if any(sliding) and sliding_scaling is not None:
        raise ConversionError(
            f"{source}: Gemma 3's sliding-window layers with {sliding_scaling.kind} rope scaling: megatron-core has one rope a "
            "model (GPTModel's), and mconvert's Gemma 3 layer spec gives those layers their theta unscaled"
        )
    spec = read_dense_spec(
        # transformers' Gemma 3 reads hidden_activation, not hidden_act; its MLP has no biases.
        {k: v for k, v in config.items() if k not in ("hidden_act", "rope_parameters", "rope_scaling")} | {"mlp_bias": False},
        "gemma3_text", source, applies_sliding_window=False,
        rope_theta=theta, rope_scaling=scaling, activation="gelu_tanh", qk_norm=True, zero_centered_norms=True,
        norms_after_sublayers=True, embeddings_scaled=True,
        sliding_window=int(config["sliding_window"]) if any(sliding) else None,
        sliding_layers=sliding if any(sliding) and not all(sliding) else None,
        sliding_window_rope_theta=sliding_theta if any(sliding) else None,
    )
    scale_dim = config["query_pre_attn_scalar"]
    return dataclasses.replace(spec, attention_scale_dim=None if scale_dim == spec.head_dim else int(scale_dim))


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """An image-text checkpoint's language model (`text_config`); the outer config is kept for the way back."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConversionError(f"{source}: model_type '{config.get('model_type')}' has a text_config that is not an object")
    outer = {field: config[field] for field in ("tie_word_embeddings", "dtype", "torch_dtype") if field in config}
    spec = read_text_config({**outer, **text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}, source)
    return dataclasses.replace(spec, family="gemma3", hf_config=dict(config))


def write_text_config(spec: ModelSpec) -> dict[str, Any]:
    config = write_dense_config(spec, "gemma3_text", "Gemma3ForCausalLM")
    # What Gemma3TextConfig reads otherwise, or derives layer_types from (the hub's sliding_window_pattern).
    for field in ("hidden_act", "use_sliding_window", "sliding_window_pattern", "_sliding_window_pattern"):
        config.pop(field, None)
    sliding = spec.sliding_layers or (spec.sliding_window is not None,) * spec.num_layers
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=spec.attention_scale_dim or spec.head_dim,
        sliding_window=spec.sliding_window or spec.hf_config.get("sliding_window", DEFAULTS["sliding_window"]),
        layer_types=[LAYER_TYPES[not windowed] for windowed in sliding],
        rope_local_base_freq=spec.sliding_window_rope_theta or DEFAULT_THETA["sliding_attention"],
    )
    return config


def write_config(spec: ModelSpec) -> dict[str, Any]:
    outer = dict(spec.hf_config)
    text = write_text_config(dataclasses.replace(spec, hf_config=dict(outer.get("text_config") or {})))
    outer.update(
        text_config=text, model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
        tie_word_embeddings=not spec.untie_embeddings,
    )
    return outer


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    model_sizes=("gemma3-vision", "gemma-3-vision"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Gemma3ForConditionalGeneration", "gemma3"),),
)

TEXT_FAMILY = Family(
    name="gemma3_text",
    model_types=("gemma3_text",),
    # The text model is what a Megatron checkpoint holds, and Gemma 3's 270M and 1B have no other.
    model_sizes=("gemma3", "gemma-3"),
    table=TEXT_TABLE,
    read_config=read_text_config,
    write_config=write_text_config,
    architectures=(("Gemma3ForCausalLM", "gemma3_text"),),
)
