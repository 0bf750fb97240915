"""The model that stored Megatron-LM args describe: a ModelSpec read back from a checkpoint's args (the inverse of
mconvert.megatron_lm.args.megatron_args), as Megatron-LM reads them, defaults included, by the settings table
(mconvert.megatron_lm.settings); here only the ModelSpec fields that several args make together."""

from __future__ import annotations

import argparse
from typing import Any

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings.mamba_spec import MambaSpec
from mconvert.mappings.rope import RopeScaling
from mconvert.mappings.spec import (
    DTYPES,
    LinearAttentionSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
    SparseAttentionSpec,
    dsa_indexer_layers,
)
from mconvert.mcore import hybrid
from mconvert.megatron_lm.args import MLA_YARN_DEFAULTS
from mconvert.megatron_lm.hybrid_args import gpt_view
from mconvert.megatron_lm.setting import Getter
from mconvert.megatron_lm.settings import FEATURES, SETTINGS, getter, has_feature
from mconvert.megatron_lm.spec_names import (
    GEMMA3_LAYERS,
    GEMMA3_SLIDING_WINDOW_ROPE_THETA,
    NORMS_AFTER_SUBLAYERS,
    QK_NORM_ACROSS_HEADS,
)

# The sub-specs a model has where its args have the feature of the same name.
SUB_SPECS = {"moe": MoESpec, "mla": MLASpec, "linear_attention": LinearAttentionSpec,
             "sparse_attention": SparseAttentionSpec, "mamba": MambaSpec}


def spec_from_args(
    args: argparse.Namespace, family: str = "", vocab_size: int | None = None, hf_config: dict[str, Any] | None = None
) -> ModelSpec:
    """The model that Megatron-LM `args` describe (the inverse of `megatron_args`), read as Megatron-LM reads
    them, defaults included. Args name no family: `family` is the caller's (see
    mconvert.mappings.family_for_spec). `vocab_size` is the real vocabulary when args lack it (Megatron-LM
    takes it from the tokenizer and may store only the padded size). Features no family has are errors."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    blocks, mtp_blocks = hybrid.split_pattern(pattern) if pattern and hybrid.has_mamba(pattern) else (None, [])
    args = gpt_view(args)
    get = getter(args)
    if (refused := _refused(get)) is not None:
        raise ConversionError(f"args describe a model with {refused}, which no supported family has")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
        if get(name) is None:
            raise ConversionError(f"args: required argument '{name}' is missing")
    vocab = getattr(args, "vocab_size", None) or vocab_size
    if vocab is None:
        raise ConversionError("args record no vocab_size (only the padded size): pass --hf-config with the real vocabulary")
    layer_spec = tuple(get("spec") or ())
    if layer_spec not in ((), QK_NORM_ACROSS_HEADS, NORMS_AFTER_SUBLAYERS, GEMMA3_LAYERS) and layer_spec[0] != "local":
        raise ConversionError(f"args: spec {' '.join(layer_spec)}: a layer spec of its own, whose layers mconvert does not know")

    fields: dict[str, Any] = {}
    sub_fields: dict[str, dict[str, Any]] = {name: {} for name in SUB_SPECS}
    for setting in SETTINGS:
        if setting.spec is None or not has_feature(setting, get):
            continue
        scope, _, name = setting.spec.rpartition(".")
        (sub_fields[scope] if scope else fields)[name] = setting.read(get) if setting.read is not None else get(setting.arg)
    for scope, cls in SUB_SPECS.items():
        present = FEATURES[scope][1](get)
        fields[scope] = cls(**sub_fields[scope], **_sub_spec_fields(scope, get, fields)) if present else None
    mla = fields["mla"]
    fields.update(
        family=family,
        vocab_size=vocab,
        # Multi-latent attention's qk_layernorm is its latent norms, not q/k norms.
        qk_norm=bool(get("qk_layernorm")) and mla is None,
        qk_norm_across_heads=layer_spec in (QK_NORM_ACROSS_HEADS, NORMS_AFTER_SUBLAYERS),
        norms_before_sublayers=layer_spec != NORMS_AFTER_SUBLAYERS,
        norms_after_sublayers=layer_spec in (NORMS_AFTER_SUBLAYERS, GEMMA3_LAYERS),
        # Gemma 3's layer spec gives the sliding-window layers (where the model has them) their own rope.
        sliding_window_rope_theta=GEMMA3_SLIDING_WINDOW_ROPE_THETA if layer_spec == GEMMA3_LAYERS and get("window_size") else None,
        dtype=_params_dtype(get),
        rope_scaling=_rope_scaling(get),
        activation=_activation(get, layer_spec),
        position_embeddings="none" if get("position_embedding_type") == "none" else "rope",
        layer_blocks=blocks,
        mtp_blocks=mtp_blocks[0] if mtp_blocks else None,
        hf_config=dict(hf_config or {}),
        **_sliding_window(get),
    )
    return ModelSpec(**fields)


def _refused(get: Getter) -> str | None:
    """What the args hold that mconvert does not read back, named; None where it reads them all."""
    for setting in SETTINGS:
        if setting.accepts is not None and get(setting.arg) not in setting.accepts:
            accepted = " or ".join(repr(value) for value in setting.accepts if value is not None)
            return f"{setting.arg.replace('_', ' ')} {get(setting.arg)!r} (args.{setting.arg}; {accepted} supported)"
    if not (get("swiglu") or get("quick_geglu") or get("squared_relu") or tuple(get("spec") or ()) == GEMMA3_LAYERS):
        return "an MLP without SwiGLU, quick-GEGLU or squared ReLU"
    return None


def _activation(get: Getter, layer_spec: tuple[str, ...]) -> str:
    """The MLP's activation: its flag's, or Gemma 3's layer spec's GeGLU, which no flag names."""
    if layer_spec == GEMMA3_LAYERS:
        return "gelu_tanh"
    return "quick_gelu" if get("quick_geglu") else "squared_relu" if get("squared_relu") else "silu"


def _sub_spec_fields(scope: str, get: Getter, fields: dict[str, Any]) -> dict[str, Any]:
    """A sub-spec's fields that several args make: sparse attention's indexer layers, from megatron-core's
    dsa_indexer_topk_freq and dsa_indexer_skip_topk_offset."""
    if scope != "sparse_attention":
        return {}
    layers = dsa_indexer_layers(get("dsa_indexer_topk_freq") or 1, get("dsa_indexer_skip_topk_offset") or 0, fields["num_layers"])
    return {"indexer_layers": layers}


def _params_dtype(get: Getter) -> Any:
    """The weights' dtype: torch's params_dtype as Megatron-LM stores it, else its bf16 and fp16 switches."""
    stored = str(get("params_dtype")).removeprefix("torch.")
    if stored in DTYPES:
        return DTYPES[stored]
    return dtypes.bfloat16 if get("bf16") else dtypes.float16 if get("fp16") else dtypes.float32


def _rope_scaling(get: Getter) -> RopeScaling | None:
    """Rope scaling: multi-latent attention's YaRN (its rope type yarn with a factor other than 1), GPTModel's YaRN,
    llama3 scaling, or linear position interpolation."""
    if get("multi_latent_attention") and (get("rope_type") or "yarn") == "yarn" and float(get("rotary_scaling_factor")) != 1.0:
        return RopeScaling(
            kind="yarn",
            factor=float(get("rotary_scaling_factor")),
            mscale=float(get("mscale")),
            mscale_all_dim=float(get("mscale_all_dim")),
            **{field: type(default)(get(field)) for field, default in MLA_YARN_DEFAULTS.items()},
        )
    if get("position_embedding_type") == "yarn":
        # The defaults YarnRotaryEmbedding takes where the args hold none.
        original, fast, slow, rounded = (get(name) for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast",
                                                                "yarn_beta_slow", "yarn_correction_range_round_to_int"))
        return RopeScaling(
            kind="yarn",
            factor=float(get("rotary_scaling_factor")),
            original_max_position_embeddings=int(4096 if original is None else original),
            beta_fast=float(32.0 if fast is None else fast),
            beta_slow=float(1.0 if slow is None else slow),
            mscale=float(get("mscale")),
            mscale_all_dim=float(get("mscale_all_dim")),
            truncate=bool(True if rounded is None else rounded),
        )
    if get("use_rope_scaling"):
        return RopeScaling(kind="llama3", factor=float(get("rope_scaling_factor")))
    if get("rotary_seq_len_interpolation_factor") is not None:
        return RopeScaling(kind="linear", factor=float(get("rotary_seq_len_interpolation_factor")))
    return None


def _sliding_window(get: Getter) -> dict[str, Any]:
    """The attention window (Megatron's (left, 0) excludes the position itself; HF's counts it), and which layers
    have it where only some do (Megatron-LM's window_attn_skip_freq: an int N skips every N-th layer, from 1)."""
    window, skip, num_layers = get("window_size"), get("window_attn_skip_freq"), get("num_layers")
    if window is not None and window[1] != 0:
        raise ConversionError(f"args: window_size {window}: only a causal window is supported")
    if isinstance(skip, int):
        skip = [int((layer + 1) % skip != 0) for layer in range(num_layers)]
    if skip is not None and len(skip) != num_layers:
        raise ConversionError(f"args: window_attn_skip_freq has {len(skip)} entries for {num_layers} layers")
    layers = tuple(bool(windowed) for windowed in skip) if window is not None and skip is not None else None
    return dict(sliding_window=window[0] + 1 if window is not None else None,
                sliding_layers=layers if layers is None or not all(layers) else None)
