"""Every Megatron-LM setting of a converted model, declared once.

A row names the arg (its parser's dest: what common.pt stores and `--use-checkpoint-args` reads), its flag and
the flag's kind, the parser's default, the TransformerConfig field the arg becomes, and how the arg is written
from a ModelSpec and read back into one. From SETTINGS come the stored args (megatron_lm.args), the printed flags
(megatron_lm.flags), the spec read back from stored args (megatron_lm.spec_from_args) and verify's TransformerConfig
(verify.megatron_model); tests/megatron_lm holds every row's flag, kind and default to Megatron-LM's own parser, and
the TransformerConfig derived here to the one Megatron-LM derives from the printed flags.

The table's order is the order of the printed flags."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings.spec import DTYPES, ModelSpec, shared_top_k_schedule
from mconvert.mcore import hybrid
from mconvert.mcore.parallelism import PipelineSplit, padded_vocab_size
from mconvert.megatron_lm.setting import Getter, Setting, Target, integral
from mconvert.megatron_lm.spec_names import GEMMA3_LAYERS, NORMS_AFTER_SUBLAYERS, QK_NORM_ACROSS_HEADS

# The features whose models have args of their own: whether a conversion's model has it, whether stored args do.
FEATURES: dict[str, tuple[Callable[[ModelSpec, Target], bool], Callable[[Getter], bool]]] = {
    "moe": (lambda spec, target: spec.moe is not None, lambda get: bool(get("num_experts"))),
    "mla": (lambda spec, target: spec.mla is not None, lambda get: bool(get("multi_latent_attention"))),
    # YaRN as GPTModel's position embedding (multi-latent attention has its own).
    "yarn": (lambda spec, target: _gpt_yarn(spec), lambda get: get("position_embedding_type") == "yarn"),
    "linear_attention": (lambda spec, target: spec.linear_attention is not None,
                         lambda get: get("experimental_attention_variant") == "gated_delta_net"),
    "sparse_attention": (lambda spec, target: spec.sparse_attention is not None,
                         lambda get: get("experimental_attention_variant") == "dsa"),
    # A HybridModel checkpoint (megatron_lm.hybrid_args writes its args), and its Mamba layers (a pattern's `M`).
    "hybrid": (lambda spec, target: target.par.model_class == "hybrid", lambda get: bool(get("hybrid_layer_pattern"))),
    "mamba": (lambda spec, target: spec.mamba is not None, lambda get: hybrid.has_mamba(get("hybrid_layer_pattern") or "")),
    # megatron-core's MuP settings (0.19 on), which hold Gemma's embedding multiplier and attention scale.
    "mup": (lambda spec, target: spec.embeddings_scaled or spec.attention_scale_dim is not None, lambda get: bool(get("use_mup"))),
}


def _rope_kind(spec: ModelSpec) -> str | None:
    return spec.rope_scaling.kind if spec.rope_scaling is not None else None


def _gpt_yarn(spec: ModelSpec) -> bool:
    return _rope_kind(spec) == "yarn" and spec.mla is None


def _position_embedding_type(spec: ModelSpec) -> str:
    if spec.position_embeddings == "none":
        return "none"
    return "yarn" if _gpt_yarn(spec) else "rope"


def _rope(field: str, default: Any) -> Callable[[ModelSpec, Target], Any]:
    """A YaRN setting of the model's rope scaling, or megatron-core's value for none (an unscaled MLA rope needs a
    scaling factor of 1, not MLA's default 40)."""
    return lambda spec, target: getattr(spec.rope_scaling, field) if spec.rope_scaling is not None else default


def _linear_attention_freq(layers: tuple[bool, ...]) -> int | list[int]:
    """Megatron's --linear-attention-freq: N makes every N-th layer (from 1) full attention; other patterns are one
    0/1 a layer (1: linear attention)."""
    full = [layer for layer, linear in enumerate(layers) if not linear]
    every = full[0] + 1 if full else 0
    regular = every > 1 and layers == tuple(bool((layer + 1) % every) for layer in range(len(layers)))
    return every if regular else [int(linear) for linear in layers]


def _linear_layers(get: Getter) -> tuple[bool, ...]:
    freq, num_layers = get("linear_attention_freq"), get("num_layers")
    if isinstance(freq, int):
        return tuple(bool((layer + 1) % freq) for layer in range(num_layers))
    if not isinstance(freq, list) or len(freq) != num_layers:
        raise ConversionError(f"args: linear_attention_freq {freq!r} is neither an int nor one 0/1 per layer of {num_layers}")
    return tuple(bool(x) for x in freq)


def _moe_layers(get: Getter) -> tuple[bool, ...]:
    """Megatron's --moe-layer-freq: every k-th layer from layer 0 for an int k, else one 0/1 per layer. Megatron-LM
    parses the flag's string form ("([0]*1+[1]*3)") when it reads its command line, so stored args hold the int or
    the list."""
    freq, num_layers = get("moe_layer_freq"), get("num_layers")
    if isinstance(freq, str):
        raise ConversionError(f"args: moe_layer_freq is the string {freq!r}; Megatron-LM stores it parsed, as an int or a list")
    if isinstance(freq, int):
        return tuple(layer % freq == 0 for layer in range(num_layers))
    if len(freq) != num_layers:
        raise ConversionError(f"args: moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(bool(x) for x in freq)


def _top_k_schedule(spec: ModelSpec) -> tuple[int, int]:
    """megatron-core's (dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) for the layers that run an indexer."""
    layers = spec.sparse_attention.indexer_layers
    return shared_top_k_schedule(layers) if not all(layers) else (1, 0)


def _layer_spec(spec: ModelSpec, target: Target) -> list[str] | None:
    """mconvert's layer spec that builds the model's layers, where megatron-core's own specs cannot: Gemma 3's (norms
    before and after the sublayers), OLMo 2's (norms after the sublayers, with q/k norms across heads), or q/k norms
    across heads alone."""
    if spec.norms_after_sublayers:
        return list(GEMMA3_LAYERS if spec.norms_before_sublayers else NORMS_AFTER_SUBLAYERS)
    return list(QK_NORM_ACROSS_HEADS) if spec.qk_norm_across_heads else None


def _embedding_multiplier(spec: ModelSpec, target: Target) -> float:
    """sqrt(hidden_size) as transformers' Gemma scales its embeddings by it: made an fp32 tensor, then cast to the
    weights' dtype (34.0, not 33.94, for a width of 1152 in bf16)."""
    return float(np.float32(spec.hidden_size**0.5).astype(target.dtype)) if spec.embeddings_scaled else 1.0


def _embeddings_scaled(get: Getter) -> bool:
    multiplier, width = float(get("mup_embedding_mult")), get("hidden_size")
    if multiplier == 1.0:
        return False
    if multiplier not in {float(np.float32(width**0.5).astype(dtype)) for dtype in DTYPES.values()}:
        raise ConversionError(f"args: mup_embedding_mult {multiplier!r} is not sqrt(hidden_size {width}) in any dtype: no family scales its embeddings so")
    return True


def _attention_scale_dim(get: Getter) -> int | None:
    """The width whose 1/sqrt scales the attention scores, from MuP's softmax scale sqrt(mup_base_head_dim) /
    kv_channels^mup_attn_scale_power; None where it is the heads' own. An integer (as Gemma's query_pre_attn_scalar),
    within the float rounding of the division."""
    head_dim = get("kv_channels") or get("hidden_size") // get("num_attention_heads")
    width = head_dim ** (2 * float(get("mup_attn_scale_power"))) / float(get("mup_base_head_dim") or 1.0)
    if abs(width - round(width)) > 1e-9 * width:
        raise ConversionError(f"args: MuP's attention scale is 1/sqrt({width!r}), of no integer width: no family scales its attention so")
    return None if round(width) == head_dim else round(width)


def _tokenizer_type(spec: ModelSpec, target: Target) -> str | None:
    return "HuggingFaceTokenizer" if target.tokenizer is not None else None


def _pipeline(field: str) -> Callable[[ModelSpec, Target], Any]:
    return lambda spec, target: getattr(target.par.pipeline, field)


MOE, MLA, YARN = ("moe",), ("mla",), ("yarn",)
LINEAR, SPARSE, MAMBA, MUP = ("linear_attention",), ("sparse_attention",), ("mamba",), ("mup",)
# TransformerConfig's names of the pipeline split args where they differ (core_transformer_config_from_args).
_SPLIT_CONFIG_FIELDS = {
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}

SETTINGS: tuple[Setting, ...] = (
    # The model's size.
    Setting("num_layers", spec="num_layers", show="always"),
    Setting("hidden_size", spec="hidden_size", show="always"),
    Setting("ffn_hidden_size", spec="ffn_hidden_size", show="always"),
    Setting("num_attention_heads", spec="num_attention_heads", show="always"),
    # Multi-latent attention's heads are its key's: the part without rope and the rope part.
    Setting("kv_channels", spec="head_dim", show="always",
            read=lambda get: get("qk_head_dim") + get("qk_pos_emb_head_dim") if get("multi_latent_attention")
            else get("kv_channels") or get("hidden_size") // get("num_attention_heads")),
    Setting("max_position_embeddings", spec="max_position_embeddings", show="always", config=None),
    Setting("seq_length", value=lambda spec, target: min(spec.max_position_embeddings, 4096), show="always", config=None),
    # Position embeddings. YaRN is GPTModel's position embedding of its own; under multi-latent attention, MLA's rope type.
    Setting("position_embedding_type", "learned_absolute", value=lambda spec, target: _position_embedding_type(spec),
            show="always", config=None, accepts=("rope", "yarn", "none")),
    Setting("rotary_base", 10000, spec="rope_theta", encode=lambda theta: integral(theta, "--rotary-base", "rope_theta"),
            read=lambda get: float(get("rotary_base")), show="always"),
    Setting("normalization", "LayerNorm", value=lambda spec, target: "RMSNorm", show="always", accepts=("RMSNorm",)),
    Setting("layernorm_epsilon", 1e-5, spec="norm_eps", flag="--norm-epsilon", stored_as="norm_epsilon",
            read=lambda get: float(get("layernorm_epsilon")), show="always"),
    # The MLP: SwiGLU, gpt-oss's quick-GEGLU, or Nemotron-H's squared ReLU (spec.activation, read back below).
    Setting("quick_geglu", False, value=lambda spec, target: spec.activation == "quick_gelu", kind="switch", config=None),
    Setting("squared_relu", False, value=lambda spec, target: spec.activation == "squared_relu", kind="switch", config=None),
    Setting("swiglu", False, value=lambda spec, target: spec.activation == "silu", kind="switch", config=None),
    # HF models train with the config's attention dropout and no hidden dropout; Megatron-LM's default is 0.1.
    Setting("attention_dropout", 0.1, spec="attention_dropout", read=lambda get: float(get("attention_dropout")), show="always"),
    Setting("hidden_dropout", 0.1, value=lambda spec, target: 0.0, show="always"),
    # Megatron-LM's parser default (--no-position-embedding is deprecated): what its own saves hold, and what a
    # resumption's check_checkpoint_args compares the run's args with. The model reads position_embedding_type.
    Setting("add_position_embedding", True, value=lambda spec, target: True, flag="--no-position-embedding", kind="negated",
            config=None),
    # Its flag is deprecated: position_embedding_type says it.
    Setting("use_rotary_position_embeddings", False, value=lambda spec, target: spec.position_embeddings != "none",
            flag=None, config=None),
    Setting("rotary_interleaved", False, spec="rotary_interleaved", kind="switch"),
    Setting("sequence_parallel", False, feature=SPARSE, kind="switch",
            # Sparse attention's absorbed MLA requires it at TP > 1.
            value=lambda spec, target: target.par.tp > 1),
    # What Megatron-LM's validation leaves of its default: off beside another position embedding than rope, and off
    # where megatron-core refuses it (Megatron-LM turns it off by itself beside the others): beside sparse attention,
    # and under multi-latent attention without YaRN (GLM-4.7-Flash).
    Setting("apply_rope_fusion", True, flag="--no-rope-fusion", kind="negated",
            value=lambda spec, target: _position_embedding_type(spec) == "rope" and spec.sparse_attention is None
            and (spec.mla is None or _rope_kind(spec) == "yarn"),
            show=lambda get: not get("apply_rope_fusion") and get("position_embedding_type") == "rope"),
    # GPTModel's argument (and a field of multi-latent attention's config).
    Setting("rotary_percent", 1.0, spec="rotary_percent", read=lambda get: float(get("rotary_percent"))),
    Setting("group_query_attention", False, value=lambda spec, target: spec.num_query_groups != spec.num_attention_heads,
            kind="switch", config=None),
    # Megatron-LM ignores --num-query-groups unless --group-query-attention is given.
    Setting("num_query_groups", 1, spec="num_query_groups", show=lambda get: get("group_query_attention"), config=None,
            read=lambda get: get("num_query_groups") if get("group_query_attention") else get("num_attention_heads")),
    Setting("use_rope_scaling", False, value=lambda spec, target: _rope_kind(spec) == "llama3", kind="switch", config=None),
    Setting("rope_scaling_factor", 8.0, value=lambda spec, target: spec.rope_scaling.factor if _rope_kind(spec) == "llama3" else 8.0,
            show=lambda get: get("use_rope_scaling"), config=None),
    Setting("rotary_seq_len_interpolation_factor", config=None,
            value=lambda spec, target: integral(spec.rope_scaling.factor, "--rotary-seq-len-interpolation-factor",
                                                "rope_scaling factor") if _rope_kind(spec) == "linear" else None),
    # Megatron-LM's (left, right) window excludes the position itself; HF's `sliding_window` counts it.
    Setting("window_size", value=lambda spec, target: (spec.sliding_window - 1, 0) if spec.sliding_window is not None else None),
    # 1 where the window applies, per layer (Megatron numbers them from 1), where only some layers have it.
    Setting("window_attn_skip_freq", value=lambda spec, target: [int(w) for w in spec.sliding_layers] if spec.sliding_layers else None),
    Setting("softmax_type", "vanilla", spec="softmax_type"),
    Setting("glu_linear_offset", 0.0, spec="glu_linear_offset", read=lambda get: float(get("glu_linear_offset"))),
    Setting("activation_func_clamp_value", spec="activation_clamp"),
    # YaRN, as GPTModel's position embedding (all seven) or multi-latent attention's (the first three).
    Setting("rotary_scaling_factor", 1.0, feature=("yarn", "mla"), value=_rope("factor", 1.0), show="always"),
    Setting("mscale", 1.0, feature=("yarn", "mla"), value=_rope("mscale", 1.0), show="always"),
    Setting("mscale_all_dim", 0.0, feature=("yarn", "mla"), value=_rope("mscale_all_dim", 0.0), show="always"),
    Setting("yarn_original_max_position_embeddings", feature=YARN, value=_rope("original_max_position_embeddings", None),
            show="always", config=None),
    Setting("yarn_beta_fast", feature=YARN, value=_rope("beta_fast", None), show="always", config=None),
    Setting("yarn_beta_slow", feature=YARN, value=_rope("beta_slow", None), show="always", config=None),
    Setting("yarn_correction_range_round_to_int", feature=YARN, value=_rope("truncate", None), kind="boolean", config=None),
    # Biases are Megatron-LM's default: it has no --add-bias-linear.
    Setting("add_bias_linear", True, spec="linear_bias", flag="--disable-bias-linear", kind="negated"),
    # Megatron-LM's TEGroupedMLP refuses its default bias-dropout fusion for experts with biases (gpt-oss).
    Setting("bias_dropout_fusion", True, flag="--no-bias-dropout-fusion", kind="negated",
            value=lambda spec, target: not (spec.linear_bias and spec.moe is not None)),
    Setting("add_qkv_bias", False, spec="qkv_bias", kind="switch", show=lambda get: get("add_qkv_bias") and not get("add_bias_linear"),
            read=lambda get: get("add_bias_linear") or bool(get("add_qkv_bias"))),
    # Multi-latent attention's latent norms exist only with it; they are not q/k norms.
    Setting("qk_layernorm", False, value=lambda spec, target: spec.qk_norm or spec.mla is not None, kind="switch"),
    # Megatron-LM's --spec: the layer spec function its model builder calls instead of its default one.
    Setting("spec", value=_layer_spec, kind="words", config=None),
    Setting("layernorm_zero_centered_gamma", False, spec="zero_centered_norms", flag="--apply-layernorm-1p", kind="switch",
            stored_as="apply_layernorm_1p"),
    Setting("attention_output_gate", False, spec="attention_output_gate", kind="switch"),
    Setting("untie_embeddings_and_output_weights", False, spec="untie_embeddings", kind="switch", config=None),
    # Gemma's embeddings x sqrt(hidden_size) and attention scale 1/sqrt(query_pre_attn_scalar): megatron-core's MuP
    # settings (0.19 on) at width multiplier 1 (no --mup-base-hidden-size: its learning rates and initialisation are
    # the usual ones), the attention scale sqrt(mup_base_head_dim) / kv_channels^0.5.
    Setting("use_mup", False, feature=MUP, value=lambda spec, target: True, kind="switch"),
    Setting("mup_embedding_mult", 1.0, feature=MUP, spec="embeddings_scaled", value=_embedding_multiplier, read=_embeddings_scaled),
    Setting("mup_attn_scale_power", 1.0, feature=MUP, value=lambda spec, target: 0.5),
    Setting("mup_base_head_dim", feature=MUP, spec="attention_scale_dim", read=_attention_scale_dim,
            value=lambda spec, target: spec.head_dim / spec.attention_scale_dim if spec.attention_scale_dim else None),
    # Experts: the router, the shared experts; Megatron-LM's way of running them.
    Setting("num_experts", spec="moe.num_experts", show="always", config="num_moe_experts"),
    Setting("moe_router_topk", 2, feature=MOE, spec="moe.top_k", show="always"),
    Setting("moe_ffn_hidden_size", feature=MOE, spec="moe.ffn_hidden_size", show="always",
            read=lambda get: get("moe_ffn_hidden_size") or get("ffn_hidden_size")),
    Setting("moe_shared_expert_intermediate_size", feature=MOE, spec="moe.shared_expert_ffn_hidden_size"),
    Setting("moe_shared_expert_gate", False, feature=MOE, spec="moe.shared_expert_gate", kind="switch"),
    Setting("expert_model_parallel_size", 1, value=lambda spec, target: target.par.ep, run=True,
            show=lambda get: bool(get("num_experts"))),
    Setting("expert_tensor_parallel_size", value=lambda spec, target: target.par.expert_tp, run=True,
            show=lambda get: bool(get("num_experts"))),
    Setting("moe_router_load_balancing_type", "aux_loss", feature=MOE, value=lambda spec, target: "aux_loss", show="always"),
    # The load-balancing loss's weight in training; no effect on the weights.
    Setting("moe_aux_loss_coeff", 0.0, feature=MOE, spec="moe.aux_loss_coeff", show="always",
            read=lambda get: float(get("moe_aux_loss_coeff"))),
    Setting("moe_token_dispatcher_type", "allgather", feature=MOE, value=lambda spec, target: "alltoall", show="always"),
    # Grouped GEMM experts are TEGroupedMLP under Transformer Engine; the local spec's would be the legacy GroupedMLP
    # (CUDA-only grouped_gemm package), so it gets SequentialMLP. Same checkpoint keys.
    Setting("moe_grouped_gemm", False, feature=MOE, value=lambda spec, target: target.transformer_impl == "transformer_engine",
            kind="switch"),
    Setting("moe_router_pre_softmax", False, feature=MOE, spec="moe.router_pre_softmax", kind="switch"),
    Setting("moe_layer_freq", 1, feature=MOE, spec="moe.moe_layers", read=_moe_layers,
            encode=lambda layers: 1 if all(layers) else [int(is_moe) for is_moe in layers]),
    Setting("moe_router_dtype", feature=MOE, spec="moe.router_fp32", encode=lambda fp32: "fp32" if fp32 else None,
            read=lambda get: get("moe_router_dtype") == "fp32"),
    Setting("moe_router_score_function", "softmax", feature=MOE, spec="moe.score_function", accepts=("softmax", "sigmoid")),
    Setting("moe_router_enable_expert_bias", False, feature=MOE, spec="moe.expert_bias", kind="switch"),
    Setting("moe_router_topk_scaling_factor", feature=MOE, spec="moe.topk_scaling_factor"),
    Setting("moe_router_num_groups", feature=MOE, spec="moe.num_groups"),
    Setting("moe_router_group_topk", feature=MOE, spec="moe.group_topk"),
    # Latent MoE: the routed experts' width, with the projections into it and back (Nemotron 3 Super).
    Setting("moe_latent_size", feature=MOE, spec="moe.latent_size"),
    # Multi-latent attention.
    Setting("multi_latent_attention", False, feature=MLA, value=lambda spec, target: True, kind="switch"),
    Setting("q_lora_rank", feature=MLA, spec="mla.q_lora_rank"),
    Setting("kv_lora_rank", 32, feature=MLA, spec="mla.kv_lora_rank", show="always"),
    Setting("qk_head_dim", 128, feature=MLA, spec="mla.qk_head_dim", show="always"),
    Setting("qk_pos_emb_head_dim", 64, feature=MLA, spec="mla.qk_pos_emb_head_dim", show="always"),
    Setting("v_head_dim", 128, feature=MLA, spec="mla.v_head_dim", show="always"),
    Setting("rope_type", feature=MLA, value=lambda spec, target: "yarn" if spec.rope_scaling is not None else "rope", show="always"),
    # MLATransformerConfig's YaRN fields that Megatron-LM's command line cannot set (its --yarn-* flags apply to
    # --position-embedding-type yarn only), with the defaults megatron-core 0.16.1 and 0.19.2 share; its
    # core_transformer_config_from_args copies them into the config when a run's args hold them.
    Setting("original_max_position_embeddings", 4096, feature=MLA, value=_rope("original_max_position_embeddings", 4096), flag=None),
    Setting("beta_fast", 32.0, feature=MLA, value=_rope("beta_fast", 32.0), flag=None),
    Setting("beta_slow", 1.0, feature=MLA, value=_rope("beta_slow", 1.0), flag=None),
    Setting("mtp_num_layers", spec="mtp_layers", encode=lambda layers: layers or None, read=lambda get: get("mtp_num_layers") or 0),
    # Gated delta-net beside full attention, or DeepSeek Sparse Attention's indexer beside MLA.
    Setting("experimental_attention_variant", feature=LINEAR + SPARSE, accepts=(None, "gated_delta_net", "dsa"),
            value=lambda spec, target: "gated_delta_net" if spec.linear_attention is not None else "dsa"),
    Setting("linear_attention_freq", feature=LINEAR, spec="linear_attention.layers", encode=_linear_attention_freq,
            read=_linear_layers, show="always"),
    Setting("linear_conv_kernel_dim", 4, feature=LINEAR, spec="linear_attention.conv_kernel", show="always"),
    Setting("linear_key_head_dim", 128, feature=LINEAR, spec="linear_attention.key_head_dim", show="always"),
    Setting("linear_value_head_dim", 128, feature=LINEAR, spec="linear_attention.value_head_dim", show="always"),
    Setting("linear_num_key_heads", 16, feature=LINEAR, spec="linear_attention.key_heads", show="always"),
    Setting("linear_num_value_heads", 32, feature=LINEAR, spec="linear_attention.value_heads", show="always"),
    Setting("dsa_indexer_n_heads", feature=SPARSE, spec="sparse_attention.index_heads", show="always"),
    Setting("dsa_indexer_head_dim", feature=SPARSE, spec="sparse_attention.index_head_dim", show="always"),
    Setting("dsa_indexer_topk", feature=SPARSE, spec="sparse_attention.topk", show="always"),
    # The layers without an indexer reuse the top-k of the last that has one (GLM-5.1's shared layers).
    Setting("dsa_indexer_topk_freq", 1, feature=SPARSE, value=lambda spec, target: _top_k_schedule(spec)[0]),
    Setting("dsa_indexer_skip_topk_offset", 0, feature=SPARSE, value=lambda spec, target: _top_k_schedule(spec)[1],
            show=lambda get: get("dsa_indexer_topk_freq") != 1),
    Setting("dsa_indexer_rope_interleaved", False, feature=SPARSE, spec="sparse_attention.rope_interleaved", kind="switch"),
    # No Hadamard rotation before scoring (see mconvert.mappings.deepseek_v32).
    Setting("dsa_indexer_rotate_activation", True, feature=SPARSE, value=lambda spec, target: False,
            flag="--no-dsa-indexer-rotate-activation", kind="negated"),
    Setting("dsa_indexer_scoring_relu", True, feature=SPARSE, value=lambda spec, target: True,
            flag="--no-dsa-indexer-scoring-relu", kind="negated", accepts=(True,)),
    # The indexer's key norm has its own epsilon in transformers; written where it differs from the model's.
    Setting("dsa_indexer_k_norm_epsilon", feature=SPARSE, spec="sparse_attention.key_norm_eps",
            value=lambda spec, target: None if spec.sparse_attention.key_norm_eps == spec.norm_eps else spec.sparse_attention.key_norm_eps,
            read=lambda get: float(get("dsa_indexer_k_norm_epsilon") if get("dsa_indexer_k_norm_epsilon") is not None
                                   else get("layernorm_epsilon"))),
    # HybridModel's layers (megatron_lm.hybrid_args writes the pattern) and its Mamba-2 mixers.
    Setting("hybrid_layer_pattern", feature=("hybrid",), value=lambda spec, target: None, config=None),
    Setting("mamba_state_dim", 128, feature=MAMBA, spec="mamba.state_dim", show="always"),
    Setting("mamba_head_dim", 64, feature=MAMBA, spec="mamba.head_dim", show="always"),
    Setting("mamba_num_groups", 8, feature=MAMBA, spec="mamba.num_groups", show="always"),
    # Megatron-LM's default without it: hidden_size x 2 / head_dim heads.
    Setting("mamba_num_heads", feature=MAMBA, spec="mamba.num_heads", show="always",
            read=lambda get: get("mamba_num_heads") or 2 * get("hidden_size") // get("mamba_head_dim")),
    # How the layers are split over pipeline stages (Parallelism.pipeline), checked against the model by megatron-core.
    *(Setting(arg, PipelineSplit.__dataclass_fields__[field].default, value=_pipeline(field),
              kind="switch" if isinstance(PipelineSplit.__dataclass_fields__[field].default, bool) else "value",
              config=_SPLIT_CONFIG_FIELDS.get(arg, ""))
      for field, arg in PipelineSplit.ARGS.items()),
    # The run: vocabulary padding, parallel sizes, dtype, layer implementation, tokenizer.
    Setting("vocab_size", value=lambda spec, target: spec.vocab_size, show="always", run=True, config=None),
    Setting("padded_vocab_size", value=lambda spec, target: padded_vocab_size(spec.vocab_size, target.par), flag=None,
            run=True, config=None),
    Setting("make_vocab_size_divisible_by", 128, value=lambda spec, target: target.par.make_vocab_size_divisible_by,
            show="always", run=True, config=None),
    Setting("tensor_model_parallel_size", 1, value=lambda spec, target: target.par.tp, show="always", run=True),
    Setting("pipeline_model_parallel_size", 1, value=lambda spec, target: target.par.pp, show="always", run=True),
    # Derived by Megatron-LM's validation from a layout of several stages a rank; stored as it stores it.
    Setting("virtual_pipeline_model_parallel_size", flag=None, run=True,
            value=lambda spec, target: target.par.pipeline.args(target.par.pp)["virtual_pipeline_model_parallel_size"]),
    Setting("transformer_impl", "transformer_engine", value=lambda spec, target: target.transformer_impl, show="always", run=True),
    Setting("bf16", False, value=lambda spec, target: target.dtype == dtypes.bfloat16, kind="switch", run=True),
    Setting("fp16", False, value=lambda spec, target: target.dtype == dtypes.float16, kind="switch", run=True),
    Setting("params_dtype", value=lambda spec, target: target.dtype, flag=None, run=True),
    Setting("tokenizer_type", value=_tokenizer_type, run=True, config=None),
    Setting("tokenizer_model", value=lambda spec, target: str(target.tokenizer.absolute()) if target.tokenizer else None,
            run=True, config=None),
)

BY_ARG = {setting.arg: setting for setting in SETTINGS}


def has_feature(setting: Setting, get: Getter) -> bool:
    return not setting.feature or any(FEATURES[name][1](get) for name in setting.feature)


def getter(args: argparse.Namespace) -> Getter:
    """The args as Megatron-LM reads them: each stored value (by its 0.19 name, or the earlier one), else its
    parser's default."""

    def get(name: str) -> Any:
        setting = BY_ARG[name]
        value = getattr(args, name, None)
        if value is None and setting.stored_as is not None:
            value = getattr(args, setting.stored_as, None)
        return setting.default if value is None else value

    return get
