"""Per-architecture mappings between HF and Megatron-Core tensors: one declarative table per family.

    from mconvert.mappings import get_mapping
    family, spec = get_mapping(json.load(open("config.json")))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek, glm4_moe, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, RopeScaling

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, deepseek.FAMILY, glm4_moe.FAMILY
    )
}


def family_for_config(config: dict[str, Any], source: str = "config.json") -> Family:
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = sorted(t for family in FAMILIES.values() for t in family.model_types)
    if "auto_map" in config:  # the model's code ships with the checkpoint (transformers' trust_remote_code)
        raise ConversionError(
            f"{source}: model_type '{model_type}' needs the checkpoint's own code (auto_map), which mconvert neither "
            f"runs nor maps (supported: {', '.join(known)})"
        )
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


def family_for_spec(spec: ModelSpec) -> Family:
    """The family whose architecture has the features of `spec`, for a model known only by its features (as
    Megatron args describe it, naming no family). Multi-latent attention: DeepSeek; experts routed by sigmoid
    scores: GLM-4.5; experts with a shared expert: Qwen2-MoE; experts with q/k norms: Qwen3-MoE; other
    experts: Mixtral. Dense with q/k norms: Qwen3; with biases on q, k and v only:
    Qwen2; else Llama. Whether the family can express every feature is `write_hf_config`'s check."""
    if spec.mla is not None:
        name = "deepseek"
    elif spec.moe is not None and spec.moe.score_function == "sigmoid":
        name = "glm4_moe"
    elif spec.moe is not None:
        name = "qwen2_moe" if spec.moe.shared_expert_ffn_hidden_size else "qwen3_moe" if spec.qk_norm else "mixtral"
    else:
        name = "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias and not spec.linear_bias else "llama"
    return FAMILIES[name]


def _differences(written: Any, meant: Any, prefix: str = "") -> list[str]:
    if dataclasses.is_dataclass(meant) and type(written) is type(meant):
        return [
            difference
            for field in dataclasses.fields(meant)
            if field.compare and field.name != "family"
            for difference in _differences(getattr(written, field.name), getattr(meant, field.name), f"{prefix}{field.name}.")
        ]
    return [] if written == meant else [f"{prefix.rstrip('.')} would read back as {written}, not {meant}"]


def write_hf_config(family: Family, spec: ModelSpec) -> dict[str, Any]:
    """The HF config.json of `spec` in `family`'s terms, checked to read back as the same model: a model
    described by other means than this family's config (Megatron args) may have features its config cannot
    say (Llama's has no q/k norms), and those must fail here rather than vanish."""
    config = family.write_config(spec)
    differences = _differences(family.read_config(config), spec)
    if differences:
        raise ConversionError(f"the {family.name} family cannot express this model: {'; '.join(differences)}")
    return config


__all__ = ["FAMILIES", "Family", "ModelSpec", "MoESpec", "RopeScaling", "Table", "family_for_config", "family_for_model_size", "family_for_spec", "get_mapping", "write_hf_config"]
