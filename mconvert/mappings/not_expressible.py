"""Architectures that no megatron-core configuration expresses, by model_type: for each, what its config.json says
the model has that megatron-core 0.19.2 lacks. Read from config.json alone, so a conversion refuses them in one line
before it reads a tensor or writes a file. Where only Megatron-LM's command line lacks a flag, or a layer spec of
mconvert's own can hold a piece, the model is not refused here.

Each piece was looked for in megatron-core 0.19.2 (paths under megatron/core/) and in transformers 5.24's model code:
- one head count, head dimension and rope for all attention layers: TransformerConfig's num_attention_heads and
  kv_channels; heterogeneous layers vary only num_query_groups and ffn_hidden_size
  (transformer/heterogeneous/heterogeneous_config.py); one RotaryEmbedding per model (models/gpt/gpt_model.py),
  whose only per-layer setting skips rope (no_rope_freq);
- one SwiGLU clamp for all layers, applied to the gate's input (activation_func_clamp_value, transformer/mlp.py);
- no logit softcapping: `softcap` appears only as flash-attention's inference argument, 0 (transformer/attention.py);
  GPTModel's output layer is outside what Megatron-LM's --spec replaces;
- no keys reused as values: linear_qkv always makes separate values (transformer/attention.py);
- attention variants gated delta-net and DeepSeek Sparse Attention only (experimental_attention_variant,
  transformer/transformer_config.py), the delta net decaying once a head (ssm/gated_delta_net/gdn.py's dt_bias_dim
  and a_log_dim: one a value head);
- one residual stream: no hyper-connections anywhere in the package.
"""

from __future__ import annotations

from typing import Any, Callable


def _per_layer(values: Any) -> bool:
    return isinstance(values, list) and len(set(map(str, values))) > 1


def _step3p5(config: dict[str, Any]) -> list[str]:
    """Step-3.5-Flash (the hub's own code; transformers 5.24 reads its config as Step3p7TextConfig)."""
    other_heads = (config.get("attention_other_setting") or {}).get("num_attention_heads", config.get("num_attention_heads"))
    limits = [limit for field in ("swiglu_limits", "swiglu_limits_shared") for limit in config.get(field) or ()]
    return [
        *([f"attention head counts per layer ({config.get('num_attention_heads')} and {other_heads})"]
          if other_heads != config.get("num_attention_heads") else []),
        *(["rope per layer (its theta and rotary fraction)"]
          if _per_layer(config.get("rope_theta")) or _per_layer(config.get("partial_rotary_factors")) else []),
        *(["SwiGLU clamps per layer"] if len(set(limits)) > 1 else []),
    ]


def _gemma4(config: dict[str, Any]) -> list[str]:
    """Gemma 4 (the image-text model's text_config, or the text model's own config)."""
    text = config.get("text_config") or config
    global_head_dim = text.get("global_head_dim")
    return [
        *(["final logit softcapping"] if text.get("final_logit_softcapping") else []),
        *([f"a head dimension per layer ({text.get('head_dim')} and {global_head_dim})"]
          if global_head_dim is not None and global_head_dim != text.get("head_dim") else []),
        *(["keys reused as values (attention_k_eq_v)"] if text.get("attention_k_eq_v") else []),
    ]


def _deepseek_v4(config: dict[str, Any]) -> list[str]:
    """DeepSeek-V4: every layer's attention reads a compressed KV (compressed sparse or heavily compressed attention),
    and the residual is hc_mult streams mixed by learned hyper-connections (always, in transformers' DeepseekV4Model)."""
    return ["compressed attention (compressed_sparse_attention, heavily_compressed_attention)",
            f"hyper-connections ({config.get('hc_mult', 4)} residual streams)"]


def _kimi_linear(config: dict[str, Any]) -> list[str]:
    """Kimi-Linear: Kimi delta attention, a delta rule whose decay is one a channel, from a low-rank forget gate."""
    kda = (config.get("linear_attn_config") or {}).get("kda_layers") or "linear_attention" in (config.get("layer_types") or ())
    return ["Kimi delta attention (a gated delta rule decaying each channel, not each head)"] if kda else []


# model_type: (the architecture's name, what of megatron-core's its config needs and megatron-core 0.19.2 lacks, and
# what else stands in the way).
NOT_EXPRESSIBLE: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]], str]] = {
    "step3p5": ("Step-3.5-Flash", _step3p5, "; transformers 5.24 has no causal-LM class for it either"),
    "gemma4": ("Gemma 4", _gemma4, ""),
    "gemma4_text": ("Gemma 4", _gemma4, ""),
    "deepseek_v4": ("DeepSeek-V4", _deepseek_v4, ""),
    "kimi_linear": ("Kimi-Linear", _kimi_linear, ""),
}


def why_not_expressible(config: dict[str, Any]) -> str | None:
    """Why no megatron-core configuration expresses the model `config` describes, in one line; None where nothing
    here says so."""
    model_type = config.get("model_type")
    if model_type not in NOT_EXPRESSIBLE:
        return None
    name, needs, besides = NOT_EXPRESSIBLE[model_type]
    missing = needs(config)
    if not missing:
        return None
    return f"model_type '{model_type}' ({name}) needs what megatron-core 0.19.2 does not have: {', '.join(missing)}{besides}"
