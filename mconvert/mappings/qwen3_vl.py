"""Qwen3-VL (`qwen3_vl`, Qwen3VLForConditionalGeneration): an image-text model whose language model is Qwen3's (q/k
norms, GQA), named as Qwen3.5's image-text checkpoints name theirs (under `model.language_model.`, its config under
`text_config`), beside a vision tower (`model.visual.`: ViT blocks, the patch merger, and the deepstack mergers whose
outputs are added to the hidden states of the language model's first layers). The deepstack additions and multimodal
rope (`mrope_section`, interleaved) hold no weight: for text, whose three position ids are equal, the language model
is Qwen3 with the plain rope of its theta. A Megatron GPT checkpoint holds the language model, the vision tower is
left out and copied back by mcore-to-hf; Megatron-Bridge's layout holds both (mconvert.converters.bridge_saves)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama, qwen3_5
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config

# Qwen3's layers under the names of Qwen's image-text checkpoints.
TABLE = dataclasses.replace(
    llama.TABLE,
    model=qwen3_5.TABLE.model,
    layer_prefix=qwen3_5.TABLE.layer_prefix,
    left_out=qwen3_5.TABLE.left_out,
    copied_back=qwen3_5.TABLE.copied_back,
)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """The language model (`text_config`); the outer config is kept for the export."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"{source}: model_type '{config.get('model_type')}' has no text_config object")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    spec = read_dense_spec({**text, "tie_word_embeddings": tied}, "qwen3_vl", source, qk_norm=True)
    return dataclasses.replace(spec, hf_config=dict(config))


def write_config(spec: ModelSpec) -> dict[str, Any]:
    """The outer config of `spec.hf_config`, its text_config written from `spec`, its rope as the source states it
    (rope_parameters, the multimodal sections kept)."""
    outer = dict(spec.hf_config)
    original = dict(outer.get("text_config") or {})
    text = write_dense_config(dataclasses.replace(spec, hf_config=original), "qwen3_vl_text", "Qwen3VLTextModel")
    text.pop("architectures")
    rope = dict(original.get("rope_parameters") or original.get("rope_scaling") or {"rope_type": "default"})
    rope.update(rope_theta=spec.rope_theta)
    for name in ("rope_theta", "rope_scaling"):
        text.pop(name, None)
    text.update(rope_parameters=rope, attention_bias=spec.linear_bias)
    outer.update(text_config=text, model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"],
                 tie_word_embeddings=not spec.untie_embeddings)
    return outer


FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    model_sizes=("qwen3-vl",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen3VLForConditionalGeneration", "qwen3_vl"),),
)
