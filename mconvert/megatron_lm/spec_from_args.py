"""The model that stored Megatron-LM args describe: a ModelSpec read back from a checkpoint's args (the inverse
of mconvert.megatron_lm.args.megatron_args), as Megatron-LM reads them, defaults included."""

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
from mconvert.megatron_lm.args import MLA_YARN_DEFAULTS, stored_arg
from mconvert.megatron_lm.hybrid_args import gpt_view
from mconvert.megatron_lm.spec_names import QK_NORM_ACROSS_HEADS


def _moe_layers(freq: int | list[int], num_layers: int) -> tuple[bool, ...]:
    """Megatron's --moe-layer-freq: every k-th layer from layer 0 for an int k, else one 0/1 per layer.
    Megatron-LM parses the flag's string form ("([0]*1+[1]*3)") when it reads its command line (argparse
    `type=moe_freq_type`), so stored args hold the int or the list."""
    if isinstance(freq, str):
        raise ConversionError(f"args: moe_layer_freq is the string {freq!r}; Megatron-LM stores it parsed, as an int or a list")
    if isinstance(freq, int):
        return tuple(layer % freq == 0 for layer in range(num_layers))
    if len(freq) != num_layers:
        raise ConversionError(f"args: moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(bool(x) for x in freq)


def _linear_layers(freq: int | list[int] | None, num_layers: int) -> tuple[bool, ...]:
    """Megatron's --linear-attention-freq: every N-th layer (from 1) full attention for an int N, else one 0/1
    per layer (1: linear attention)."""
    if isinstance(freq, int):
        return tuple(bool((layer + 1) % freq) for layer in range(num_layers))
    if not isinstance(freq, list) or len(freq) != num_layers:
        raise ConversionError(f"args: linear_attention_freq {freq!r} is neither an int nor one 0/1 per layer of {num_layers}")
    return tuple(bool(x) for x in freq)


def spec_from_args(
    args: argparse.Namespace, family: str = "", vocab_size: int | None = None, hf_config: dict[str, Any] | None = None
) -> ModelSpec:
    """The model that Megatron-LM `args` describe (the inverse of `megatron_args`), read as Megatron-LM reads
    them, defaults included. Args name no family: `family` is the caller's (see
    mconvert.mappings.family_for_spec). `vocab_size` is the real vocabulary when args lack it (Megatron-LM
    takes it from the tokenizer and may store only the padded size). Features no family has are errors."""

    pattern = getattr(args, "hybrid_layer_pattern", None)
    blocks = hybrid.split_pattern(pattern)[0] if pattern and hybrid.has_mamba(pattern) else None
    args = gpt_view(args)

    def arg(name: str, default: Any = None) -> Any:
        return stored_arg(args, name, default)

    unsupported = [
        (arg("normalization", "LayerNorm") != "RMSNorm", f"normalization {arg('normalization', 'LayerNorm')} (RMSNorm is supported)"),
        (not arg("swiglu", False) and not arg("quick_geglu", False) and not arg("squared_relu", False), "an MLP without SwiGLU, quick-GEGLU or squared ReLU"),
        (arg("position_embedding_type", "learned_absolute") not in ("rope", "yarn", "none"), f"position embeddings '{arg('position_embedding_type', 'learned_absolute')}' (rope, yarn and none are supported)"),
        (arg("experimental_attention_variant") not in (None, "gated_delta_net", "dsa"), f"the attention variant '{arg('experimental_attention_variant')}' (gated_delta_net and dsa are supported)"),
        (not arg("dsa_indexer_scoring_relu", True), "sparse-attention indexer scores without ReLU"),
        (arg("rotary_interleaved", False), "interleaved rotary embeddings"),
        (arg("moe_router_score_function", "softmax") not in ("softmax", "sigmoid"), f"router score function '{arg('moe_router_score_function')}' (softmax and sigmoid are supported)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConversionError(f"args describe a model with {what}, which no supported family has")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
        if arg(name) is None:
            raise ConversionError(f"args: required argument '{name}' is missing")
    vocab = arg("vocab_size", vocab_size)
    if vocab is None:
        raise ConversionError("args record no vocab_size (only the padded size): pass --hf-config with the real vocabulary")
    heads = args.num_attention_heads
    stored_dtype = str(arg("params_dtype")).removeprefix("torch.")  # torch's dtype as Megatron-LM stores it
    if stored_dtype in DTYPES:
        params_dtype = DTYPES[stored_dtype]
    else:
        params_dtype = dtypes.bfloat16 if arg("bf16", False) else dtypes.float16 if arg("fp16", False) else dtypes.float32
    moe: MoESpec | None = None
    if arg("num_experts"):
        moe = MoESpec(
            num_experts=args.num_experts,
            top_k=arg("moe_router_topk", 2),
            ffn_hidden_size=arg("moe_ffn_hidden_size", args.ffn_hidden_size),
            moe_layers=_moe_layers(arg("moe_layer_freq", 1), args.num_layers),
            router_pre_softmax=arg("moe_router_pre_softmax", False),
            shared_expert_ffn_hidden_size=arg("moe_shared_expert_intermediate_size"),
            shared_expert_gate=arg("moe_shared_expert_gate", False),
            score_function=arg("moe_router_score_function", "softmax"),
            expert_bias=arg("moe_router_enable_expert_bias", False),
            topk_scaling_factor=arg("moe_router_topk_scaling_factor"),
            num_groups=arg("moe_router_num_groups"),
            group_topk=arg("moe_router_group_topk"),
            aux_loss_coeff=float(arg("moe_aux_loss_coeff", 0.0)),
            router_fp32=arg("moe_router_dtype") == "fp32",
        )
    mla: MLASpec | None = None
    if arg("multi_latent_attention", False):
        mla = MLASpec(
            q_lora_rank=arg("q_lora_rank"),
            kv_lora_rank=arg("kv_lora_rank", 32),
            qk_head_dim=arg("qk_head_dim", 128),
            qk_pos_emb_head_dim=arg("qk_pos_emb_head_dim", 64),
            v_head_dim=arg("v_head_dim", 128),
        )
    if mla is not None and arg("rope_type", "yarn") == "yarn" and float(arg("rotary_scaling_factor", 1.0)) != 1.0:
        rope: RopeScaling | None = RopeScaling(
            kind="yarn",
            factor=float(args.rotary_scaling_factor),
            mscale=float(arg("mscale", 1.0)),
            mscale_all_dim=float(arg("mscale_all_dim", 0.0)),
            **{field: type(default)(arg(field, default)) for field, default in MLA_YARN_DEFAULTS.items()},
        )
    elif arg("position_embedding_type") == "yarn":
        rope = RopeScaling(
            kind="yarn",
            factor=float(arg("rotary_scaling_factor", 1.0)),
            original_max_position_embeddings=int(arg("yarn_original_max_position_embeddings", 4096)),
            beta_fast=float(arg("yarn_beta_fast", 32.0)),
            beta_slow=float(arg("yarn_beta_slow", 1.0)),
            mscale=float(arg("mscale", 1.0)),
            mscale_all_dim=float(arg("mscale_all_dim", 0.0)),
            truncate=bool(arg("yarn_correction_range_round_to_int", True)),
        )
    elif arg("use_rope_scaling", False):
        rope = RopeScaling(kind="llama3", factor=float(arg("rope_scaling_factor", 8.0)))
    elif arg("rotary_seq_len_interpolation_factor") is not None:
        rope = RopeScaling(kind="linear", factor=float(args.rotary_seq_len_interpolation_factor))
    else:
        rope = None
    linear_attention: LinearAttentionSpec | None = None
    if arg("experimental_attention_variant") == "gated_delta_net":
        linear_attention = LinearAttentionSpec(
            key_heads=arg("linear_num_key_heads", 16),
            value_heads=arg("linear_num_value_heads", 32),
            key_head_dim=arg("linear_key_head_dim", 128),
            value_head_dim=arg("linear_value_head_dim", 128),
            conv_kernel=arg("linear_conv_kernel_dim", 4),
            layers=_linear_layers(arg("linear_attention_freq"), args.num_layers),
        )
    sparse_attention: SparseAttentionSpec | None = None
    if arg("experimental_attention_variant") == "dsa":
        norm_eps = arg("dsa_indexer_k_norm_epsilon")
        sparse_attention = SparseAttentionSpec(
            index_heads=args.dsa_indexer_n_heads,
            index_head_dim=args.dsa_indexer_head_dim,
            topk=args.dsa_indexer_topk,
            rope_interleaved=bool(arg("dsa_indexer_rope_interleaved", False)),
            indexer_layers=dsa_indexer_layers(arg("dsa_indexer_topk_freq", 1) or 1, arg("dsa_indexer_skip_topk_offset", 0) or 0, args.num_layers),
            key_norm_eps=float(norm_eps if norm_eps is not None else arg("layernorm_epsilon", 1e-5)),
        )
    mamba: MambaSpec | None = None
    if blocks is not None:
        # Megatron-LM's defaults (TransformerConfig's); no heads given: hidden_size x 2 / head_dim of them.
        head_dim = arg("mamba_head_dim", 64)
        mamba = MambaSpec(
            num_heads=arg("mamba_num_heads", 2 * args.hidden_size // head_dim),
            head_dim=head_dim,
            num_groups=arg("mamba_num_groups", 8),
            state_dim=arg("mamba_state_dim", 128),
        )
    layer_spec = tuple(arg("spec") or ())
    if layer_spec not in ((), QK_NORM_ACROSS_HEADS) and layer_spec[0] != "local":
        raise ConversionError(f"args: spec {' '.join(layer_spec)}: a layer spec of its own, whose layers mconvert does not know")
    linear_bias = bool(arg("add_bias_linear", True))
    window, skip = arg("window_size"), arg("window_attn_skip_freq")
    if window is not None and window[1] != 0:
        raise ConversionError(f"args: window_size {window}: only a causal window is supported")
    if isinstance(skip, int):  # Megatron's layers are numbered from 1: every skip-th one has no window
        skip = [int((layer + 1) % skip != 0) for layer in range(args.num_layers)]
    if skip is not None and len(skip) != args.num_layers:
        raise ConversionError(f"args: window_attn_skip_freq has {len(skip)} entries for {args.num_layers} layers")
    sliding_layers = tuple(bool(windowed) for windowed in skip) if window is not None and skip is not None else None
    return ModelSpec(
        family=family,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        # Megatron-LM ignores --num-query-groups unless --group-query-attention is given.
        num_query_groups=arg("num_query_groups", heads) if arg("group_query_attention", False) else heads,
        head_dim=mla.qk_head_dim + mla.qk_pos_emb_head_dim if mla else arg("kv_channels", args.hidden_size // heads),
        vocab_size=vocab,
        max_position_embeddings=args.max_position_embeddings,
        norm_eps=float(arg("layernorm_epsilon", 1e-5)),
        rope_theta=float(arg("rotary_base", 10000)),
        rope_scaling=rope,
        untie_embeddings=bool(arg("untie_embeddings_and_output_weights", False)),
        qkv_bias=linear_bias or bool(arg("add_qkv_bias", False)),
        linear_bias=linear_bias,
        # MLA's qk_layernorm is its latent norms, not q/k norms.
        qk_norm=bool(arg("qk_layernorm", False)) and mla is None,
        qk_norm_across_heads=layer_spec == QK_NORM_ACROSS_HEADS,
        dtype=params_dtype,
        moe=moe,
        mla=mla,
        rotary_percent=float(arg("rotary_percent", 1.0)),
        mtp_layers=arg("mtp_num_layers", 0),
        sliding_window=window[0] + 1 if window is not None else None,
        sliding_layers=sliding_layers if sliding_layers is None or not all(sliding_layers) else None,
        softmax_type=arg("softmax_type", "vanilla"),
        activation="quick_gelu" if arg("quick_geglu", False) else "squared_relu" if arg("squared_relu", False) else "silu",
        glu_linear_offset=float(arg("glu_linear_offset", 0.0)),
        activation_clamp=arg("activation_func_clamp_value"),
        attention_dropout=float(arg("attention_dropout", 0.1)),
        linear_attention=linear_attention,
        sparse_attention=sparse_attention,
        attention_output_gate=bool(arg("attention_output_gate", False)),
        zero_centered_norms=bool(arg("layernorm_zero_centered_gamma", False)),
        layer_blocks=blocks,
        mamba=mamba,
        position_embeddings="none" if arg("position_embedding_type") == "none" else "rope",
        hf_config=dict(hf_config or {}),
    )
