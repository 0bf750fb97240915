"""Per-architecture mappings between HF and Megatron-Core tensors: one declarative table per family.

    from mconvert.mappings import get_mapping
    family, spec = get_mapping(json.load(open("config.json")))
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, RopeScaling

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY)
}


def family_for_config(config: dict[str, Any], source: str = "config.json") -> Family:
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = sorted(t for family in FAMILIES.values() for t in family.model_types)
    raise ConversionError(f"{source}: model_type '{model_type}' is not supported (supported: {', '.join(known)})")


def family_for_model_size(model_size: str) -> Family:
    """The family a `--model-size` value names: Megatron-LM's values (llama2-7B, llama3, mistral, yi-34B,
    qwen2.5, ...) and ours (qwen3, qwen3-moe, mixtral, ...), matched by their longest known prefix."""
    wanted = model_size.lower().replace("_", "-")
    matches = [(len(prefix), family) for family in FAMILIES.values() for prefix in family.model_sizes if wanted.startswith(prefix)]
    if not matches:
        known = sorted(p for family in FAMILIES.values() for p in family.model_sizes)
        raise ConversionError(f"--model-size '{model_size}' names no supported family (known prefixes: {', '.join(known)})")
    return max(matches, key=lambda match: match[0])[1]


def get_mapping(config: dict[str, Any], model_size: str | None = None, source: str = "config.json") -> tuple[Family, ModelSpec]:
    """The family of an HF config.json and the model it describes. `model_size`, when given, must agree."""
    family = family_for_config(config, source)
    if model_size is not None:
        named = family_for_model_size(model_size)
        if named is not family:
            raise ConversionError(
                f"--model-size '{model_size}' names family '{named.name}' but {source} has model_type "
                f"'{config.get('model_type')}' (family '{family.name}')"
            )
    return family, family.read_config(config)


__all__ = ["FAMILIES", "Family", "ModelSpec", "MoESpec", "RopeScaling", "Table", "family_for_config", "family_for_model_size", "get_mapping"]
