"""Per-architecture mappings between HF and Megatron-Core tensors: one declarative table per family.

    from mconvert.mappings import get_mapping
    family, spec = get_mapping(json.load(open("config.json")))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import (
    deepseek,
    deepseek_v32,
    ernie4_5,
    gemma3,
    glm4_moe,
    gpt_oss,
    hy_v3,
    kimi_k25,
    llama,
    minimax_m2,
    mixtral,
    nemotron_h,
    olmo2,
    olmo3,
    olmoe,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from mconvert.mappings.family import Family, Table
from mconvert.mappings.not_expressible import why_not_expressible
from mconvert.mappings.rope import RopeScaling
from mconvert.mappings.spec import ModelSpec, MoESpec

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen2_moe.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, deepseek.FAMILY, glm4_moe.FAMILY,
        deepseek_v32.FAMILY, gpt_oss.FAMILY, qwen3_next.FAMILY, qwen3_5.FAMILY, qwen3_5.TEXT_FAMILY, minimax_m2.FAMILY,
        nemotron_h.FAMILY, ernie4_5.FAMILY, olmoe.FAMILY, hy_v3.FAMILY, olmo2.FAMILY, olmo3.FAMILY, kimi_k25.FAMILY,
        gemma3.FAMILY, gemma3.TEXT_FAMILY, qwen3_vl.FAMILY,
    )
}

# Model types transformers builds that no megatron-core configuration expresses, each with what megatron-core lacks:
# refused by name rather than as unknown.
INEXPRESSIBLE: dict[str, str] = {
    "ernie4_5_moe": (
        "ERNIE 4.5 MoE's router scores experts by a softmax and adds its expert bias to the scores only to choose "
        "them, which megatron-core 0.19.2 lacks: it takes an expert bias beside sigmoid or sqrtsoftplus scores only, "
        "and its softmax routing reads none"
    ),
}


def remote_code_architecture(config: dict[str, Any]) -> tuple[Family, str] | None:
    """For a checkpoint that ships its own model code (`auto_map`, transformers' trust_remote_code) under a
    model_type no family reads: the family that maps the class of that code, as its auto_map names it for
    AutoModelForCausalLM and its `architectures` too, and that class (Kimi-K2's `kimi_k2` code is a
    DeepseekV3ForCausalLM). The shipped code is never imported or run."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict) or any(config.get("model_type") in family.model_types for family in FAMILIES.values()):
        return None
    name = str(auto_map.get("AutoModelForCausalLM", "")).rpartition(".")[2]
    if name not in (config.get("architectures") or ()):
        return None
    return next(((family, name) for family in FAMILIES.values() if name in dict(family.architectures)), None)


def language_model_of(config: dict[str, Any]) -> tuple[Family, str, str] | None:
    """For a model that ships its own code of a class transformers lacks, whose language model (text_config) ships
    code of a class mconvert maps (Kimi-K2.5's kimi_k25 around a DeepseekV3ForCausalLM): that class's family, the
    class, and the prefix of the language model's tensors in the checkpoint (`language_model.`: the family's layer
    prefix before the inner family's). None for the rest. The shipped code is never imported or run."""
    family = next((family for family in FAMILIES.values() if config.get("model_type") in family.model_types), None)
    text = config.get("text_config")
    if "auto_map" not in config or family is None or config.get("model_type") in dict(family.architectures).values() or not isinstance(text, dict):
        return None
    if (taken := remote_code_architecture(text)) is None:
        return None
    inner, architecture = taken
    return inner, architecture, family.table.layer_prefix.removesuffix(inner.table.layer_prefix)


def family_for_config(config: dict[str, Any], source: str = "config.json") -> Family:
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    if (why := why_not_expressible(config)) is not None:
        raise ConversionError(f"{source}: {why}")
    if (taken := remote_code_architecture(config)) is not None:
        return taken[0]
    if model_type in INEXPRESSIBLE:
        raise ConversionError(f"{source}: model_type '{model_type}' cannot be converted: {INEXPRESSIBLE[model_type]}")
    known = sorted(t for family in FAMILIES.values() for t in family.model_types)
    if "auto_map" in config:  # code shipped with the checkpoint (transformers' trust_remote_code), perhaps for a built-in model
        code = config["auto_map"].get("AutoModelForCausalLM", "none") if isinstance(config["auto_map"], dict) else "none"
        raise ConversionError(
            f"{source}: model_type '{model_type}' is not one mconvert maps, nor is the class of the checkpoint's own code "
            f"(auto_map: {code}), which mconvert never runs (supported: {', '.join(known)})"
        )
    raise ConversionError(f"{source}: model_type '{model_type}' is not supported (supported: {', '.join(known)})")


def how_read(config: dict[str, Any]) -> str | None:
    """What a summary says of a checkpoint that ships its own model code (`auto_map`), which is never run: the
    class it was read as, and why. None for the rest."""
    if "auto_map" not in config:
        return None
    model_type = config.get("model_type")
    family = next((family for family in FAMILIES.values() if model_type in family.model_types), None)
    if family is not None and model_type in dict(family.architectures).values():
        architecture = next(name for name, of_type in family.architectures if of_type == model_type)
        return (
            f"model_type '{model_type}' ships its own code (auto_map), which was not run: read as transformers' "
            f"built-in {architecture} (the {family.name} family), the class of that model_type"
        )
    if family is not None:  # a model transformers has no class of (Kimi-K2.5), whose language model's code is one it has
        taken, read = language_model_of(config), "its language model (text_config) read as"
    else:
        taken, read = remote_code_architecture(config), "read as"
    if taken is None:
        return None
    family, architecture = taken[:2]
    return (
        f"model_type '{model_type}' ships its own code (auto_map), which was not run: {read} "
        f"{architecture} (the {family.name} family), the class its auto_map and architectures name"
    )


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
    try:
        return family, family.read_config(config)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, OverflowError, MemoryError) as e:
        # A field of another type or range than transformers writes, where a family's rules read it unchecked.
        raise ConversionError(f"{source}: a field holds what {family.name}'s config cannot have ({type(e).__name__}: {e})") from None


def family_for_spec(spec: ModelSpec) -> Family:
    """The family whose architecture has the features of `spec`, for a model known only by its features (as
    Megatron args describe it, naming no family). Mamba layers: Nemotron-H; norms before and after the sublayers: Gemma 3's
    text model (its image-text checkpoints are told by their config); norms after the sublayers alone: OLMo 3 with
    sliding-window layers, else OLMo 2; q/k norms across heads: MiniMax-M2 with sigmoid routing, else OLMoE; gated
    delta-net layers: Qwen3-Next with experts, Qwen3.5's text model without (Qwen3.5's image-text checkpoints and its
    MoE models are told by their config, as `--hf-config` gives it); sparse attention: DeepSeek-V3.2 (GLM-5.1 where
    its indexer rotates pairs or shares top-k); multi-latent attention: DeepSeek; experts routed by sigmoid scores:
    GLM-4.5; attention sinks: gpt-oss; experts with a shared expert: Qwen2-MoE; experts with q/k norms: Qwen3-MoE;
    other experts: Mixtral. Dense with interleaved rope: ERNIE 4.5; with q/k norms: Qwen3; with biases on q, k and v
    only: Qwen2; else Llama. Whether the family can express every feature is `write_hf_config`'s check."""
    if spec.mamba is not None:
        name = "nemotron_h"
    elif spec.norms_after_sublayers and spec.norms_before_sublayers:
        name = "gemma3_text"
    elif spec.norms_after_sublayers:
        name = "olmo3" if spec.sliding_window is not None else "olmo2"
    elif spec.qk_norm_across_heads:
        name = "minimax_m2" if spec.moe is not None and spec.moe.score_function == "sigmoid" else "olmoe"
    elif spec.linear_attention is not None:
        name = "qwen3_next" if spec.moe is not None else "qwen3_5_text"
    elif spec.softmax_type == "learnable":
        name = "gpt_oss"
    elif spec.sparse_attention is not None:
        name = "deepseek_v32"
    elif spec.mla is not None:
        name = "deepseek"
    elif spec.moe is not None and spec.moe.score_function == "sigmoid":
        name = "glm4_moe"
    elif spec.moe is not None:
        name = "qwen2_moe" if spec.moe.shared_expert_ffn_hidden_size else "qwen3_moe" if spec.qk_norm else "mixtral"
    elif spec.rotary_interleaved:
        name = "ernie4_5"
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
    if (taken := remote_code_architecture(spec.hf_config)) is not None and taken[0] is family:
        # Written back as it came: under its own model_type, beside its code (auto_map is kept with the config).
        config.update(model_type=spec.hf_config["model_type"], architectures=list(spec.hf_config["architectures"]))
    differences = _differences(family.read_config(config), spec)
    if differences:
        raise ConversionError(f"the {family.name} family cannot express this model: {'; '.join(differences)}")
    return config


__all__ = [
    "FAMILIES", "INEXPRESSIBLE", "Family", "ModelSpec", "MoESpec", "RopeScaling", "Table", "family_for_config", "family_for_model_size",
    "family_for_spec", "get_mapping", "how_read", "language_model_of", "remote_code_architecture", "write_hf_config",
]
