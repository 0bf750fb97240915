"""Rope as HF configs state it and as Megatron can express it: theta and frequency scaling (llama3, linear,
YaRN), read from either config style."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mconvert.errors import ConversionError


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling that Megatron can express.

    kind "llama3": Megatron-Core's `--use-rope-scaling` (factor free; the other three numbers are fixed there).
    kind "linear": position interpolation, Megatron's `--rotary-seq-len-interpolation-factor`.
    kind "yarn": YaRN, as multi-latent attention's `--rope-type yarn` (factor, mscale, mscale_all_dim by flags;
    beta_fast, beta_slow and the original positions are MLATransformerConfig fields that Megatron-LM's command
    line cannot set: mconvert.megatron_lm.flags.settings_without_flags says how).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # YaRN's correction range rounded to whole dimensions (transformers' `truncate`, Megatron's
    # yarn_correction_range_round_to_int); gpt-oss does not round.
    truncate: bool = True


def partial_rotary_factor(config: dict[str, Any]) -> float:
    """The fraction of each head's rope dims that rope rotates, where a family's transformers class reads it (GLM's, Qwen3-Next's).
    Hub configs hold it at the top level; transformers v5 moves it into rope_parameters."""
    factor = config.get("partial_rotary_factor")
    if factor is None:
        factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return float(factor)


def read_rope(config: dict[str, Any], source: str, default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """Rope theta and scaling from either config style: hub configs' `rope_theta` + `rope_scaling`, or
    transformers v5's `rope_parameters` (which holds rope_theta and rope_type together). `default_theta` is
    what transformers uses for the family when the config names none."""
    params = config.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", config.get("rope_theta"))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = config.get("rope_theta")
        scaling = config.get("rope_scaling")
    if theta is None:
        theta = default_theta
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        rope = RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
        fixed = RopeScaling(kind="llama3", factor=rope.factor)
        if rope != fixed:
            # Megatron-Core's llama3 scaling takes only the factor; the rest are constants in its code.
            raise ConversionError(
                f"{source}: rope_scaling {scaling} differs from what Megatron-Core supports "
                f"(low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)"
            )
        return float(theta), rope
    if kind == "linear":
        return float(theta), RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "yarn":
        return float(theta), read_yarn(scaling, source)
    raise ConversionError(f"{source}: rope scaling type '{kind}' is not supported (llama3, linear and yarn are)")


def read_yarn(scaling: dict[str, Any], source: str) -> RopeScaling:
    """YaRN as transformers computes it. Its attention factor is mscale's over mscale_all_dim's when both are
    set, else mscale 1's: a lone mscale is ignored there, so it must be 1 here to mean the same."""
    if scaling.get("attention_factor") is not None:
        raise ConversionError(f"{source}: yarn attention_factor {scaling['attention_factor']} cannot be expressed in Megatron")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim") or 0.0
    if not (mscale and mscale_all_dim):
        if mscale not in (None, 1, 1.0):
            raise ConversionError(f"{source}: yarn mscale {mscale} without mscale_all_dim is ignored by transformers; set it to 1")
        mscale = 1.0
    return RopeScaling(
        kind="yarn",
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
        truncate=bool(scaling.get("truncate", True)),
    )


def hub_rope_scaling(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """`scaling` as a hub config's `rope_scaling` states it (which transformers v4 and v5 both read)."""
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim,
        }
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
