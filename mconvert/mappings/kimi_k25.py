"""Kimi-K2.5 (`kimi_k25`): an image-text model whose language model is Kimi-K2's, a DeepSeek-V3 (text_config, model_type
`kimi_k2`, read as DeepseekV3ForCausalLM as Kimi-K2 is), stored under `language_model.` (`language_model.model.layers.`,
`language_model.lm_head.weight`), beside its vision tower (MoonViT, `vision_tower.`) and the projector into the language
model (`mm_projector.`), which a Megatron GPT checkpoint does not hold: left out, and copied back by mcore-to-hf. Its
config and code are its own (auto_map); transformers has no class of it, and mconvert runs none of its code. The names
are the release's as vLLM's kimi_k25.py and mlx-lm's kimi_k25.py load them."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec

LANGUAGE_MODEL = "language_model."
ARCHITECTURE = "KimiK25ForConditionalGeneration"

# DeepSeek's table, its HF names one level down.
TABLE = deepseek.TABLE.under(
    LANGUAGE_MODEL,
    left_out=(("vision_tower.", "the vision tower"), ("mm_projector.", "the multimodal projector")),
    copied_back=("vision_tower.", "mm_projector."),
)


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """The language model (text_config); the outer config is kept for the export."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"{source}: model_type '{config.get('model_type')}' has no text_config object")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    spec = deepseek.read_config({**text, "tie_word_embeddings": tied}, source)
    return dataclasses.replace(spec, family="kimi_k25", hf_config=dict(config))


def write_config(spec: ModelSpec) -> dict[str, Any]:
    """The outer config of `spec.hf_config` with the language model's text_config written from `spec`: under Kimi's own
    model_type and class names where the original's are (kimi_k2, DeepseekV3ForCausalLM), unquantized."""
    outer = {key: value for key, value in spec.hf_config.items() if key != "quantization_config"}
    original = dict(outer.get("text_config") or {})
    text = deepseek.write_config(dataclasses.replace(spec, hf_config=original))
    if deepseek.FAMILY.hf_model_type(original) == text["model_type"]:
        text.update(model_type=original["model_type"], architectures=list(original.get("architectures") or text["architectures"]))
    outer.update(text_config=text, model_type="kimi_k25", architectures=[ARCHITECTURE], tie_word_embeddings=not spec.untie_embeddings)
    return outer


FAMILY = Family(
    name="kimi_k25",
    model_types=("kimi_k25",),
    model_sizes=("kimi-k2.5",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
)
