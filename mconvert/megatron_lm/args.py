"""Megatron-LM's args for a model: the Namespace written into common.pt (what `--use-checkpoint-args` reads),
made from a ModelSpec; how stored args are read across Megatron-LM versions; which args its
`--use-checkpoint-args` restores and what its parser defaults the others to."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings.rope import RopeScaling
from mconvert.mappings.spec import ModelSpec, MoESpec, shared_top_k_schedule
from mconvert.mcore.parallelism import Parallelism, PipelineSplit, padded_vocab_size
from mconvert.megatron_lm.hybrid_args import gpt_view, hybrid_args
from mconvert.megatron_lm.spec_names import QK_NORM_ACROSS_HEADS

# Args that Megatron-LM's `--use-checkpoint-args` copies from a checkpoint's stored args
# (megatron.training.checkpointing.load_args_from_checkpoint, Megatron-LM 0.19.2; tests/megatron_lm reads
# the installed function to keep this in step). Everything else that shapes the model must be passed.
RESTORED_BY_CHECKPOINT_ARGS = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling",
    "attention_dropout", "hidden_dropout", "mtp_hybrid_override_pattern", "mtp_num_layers", "mtp_use_repeated_layer",
    "spec", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type",
    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_single_grouped_weight", "moe_single_grouped_bias",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "hybrid_layer_pattern", "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json",
    "moe_latent_size", "tokenizer_model", "tokenizer_type", "tiktoken_pattern", "padded_vocab_size", "ckpt_format",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
})
# Megatron-LM's defaults (its argument parser, 0.19.2; tests/megatron_lm checks them) of the args that shape
# the model or how it trains: the model a run builds from a flag left out.
MEGATRON_LM_DEFAULTS: dict[str, Any] = {
    "num_layers": None, "hidden_size": None, "ffn_hidden_size": None, "num_attention_heads": None,
    "kv_channels": None, "group_query_attention": False, "num_query_groups": 1, "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "rotary_interleaved": False, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
    "swiglu": False, "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
    "untie_embeddings_and_output_weights": False, "attention_dropout": 0.1, "hidden_dropout": 0.1,
    "window_size": None, "num_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
    "moe_router_pre_softmax": False, "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False, "moe_aux_loss_coeff": 0.0, "moe_router_dtype": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
    "pipeline_model_parallel_layout": None, "softmax_type": "vanilla", "quick_geglu": False, "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None, "window_attn_skip_freq": None, "rotary_scaling_factor": 1.0, "mscale": 1.0,
    "mscale_all_dim": 0.0, "yarn_original_max_position_embeddings": None, "yarn_beta_fast": None, "yarn_beta_slow": None,
    "yarn_correction_range_round_to_int": None, "bias_dropout_fusion": True, "attention_output_gate": False,
    "experimental_attention_variant": None, "linear_attention_freq": None, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "dsa_indexer_n_heads": None, "dsa_indexer_head_dim": None, "dsa_indexer_topk": None, "dsa_indexer_topk_freq": 1,
    "dsa_indexer_skip_topk_offset": 0, "dsa_indexer_rope_interleaved": False, "dsa_indexer_rotate_activation": True,
    "dsa_indexer_scoring_relu": True, "dsa_indexer_k_norm_epsilon": None, "sequence_parallel": False,
    "apply_rope_fusion": True,
}
# Args whose name in Megatron-LM 0.19 (its parser's dest, after TransformerConfig's field) differs from the
# flag's, and from the name earlier Megatron-LM versions store: both names are written, either is read.
RENAMED_ARGS = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p"}
FLAG_OF_ARG = {
    "layernorm_epsilon": "--norm-epsilon", "layernorm_zero_centered_gamma": "--apply-layernorm-1p", "add_bias_linear": "--disable-bias-linear",
    "bias_dropout_fusion": "--no-bias-dropout-fusion", "dsa_indexer_rotate_activation": "--no-dsa-indexer-rotate-activation",
    "dsa_indexer_scoring_relu": "--no-dsa-indexer-scoring-relu", "apply_rope_fusion": "--no-rope-fusion",
}
# Files that make an HF directory usable as Megatron-LM's `--tokenizer-model` for HuggingFaceTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def stored_arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """An arg as stored by any Megatron-LM version (by its 0.19 name, or the earlier one), else `default`."""
    value = getattr(args, name, None)
    if value is None and name in RENAMED_ARGS:
        value = getattr(args, RENAMED_ARGS[name], None)
    return default if value is None else value


def _integral(value: float, flag: str, field: str) -> int:
    """`value` as the int Megatron-LM's parser declares `flag` to be; a fraction would be rounded there, so it
    is an error here."""
    if value != int(value):
        raise ConversionError(f"{field} {value:g}: Megatron-LM's {flag} takes only integers, so this model cannot be described")
    return int(value)


def megatron_args(
    spec: ModelSpec, par: Parallelism, dtype: Any, transformer_impl: str, tokenizer_dir: Path | None = None
) -> argparse.Namespace:
    """The Megatron-LM arguments that describe the model, as `--use-checkpoint-args` reads them from common.pt.
    `dtype`: the weights' (numpy's or torch's; params_dtype holds numpy's). `tokenizer_dir`: the HF directory,
    recorded as the tokenizer when it has tokenizer files."""
    dtype = dtypes.dtype_of(dtype)
    rope: RopeScaling | None = spec.rope_scaling
    if spec.position_embeddings == "none":
        position_embedding_type = "none"
    else:
        position_embedding_type = "yarn" if rope is not None and rope.kind == "yarn" and spec.mla is None else "rope"
    linear_factor = None
    if rope is not None and rope.kind == "linear":
        linear_factor = _integral(rope.factor, "--rotary-seq-len-interpolation-factor", "rope_scaling factor")
    has_tokenizer = tokenizer_dir is not None and any((tokenizer_dir / name).exists() for name in TOKENIZER_FILES)
    args: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        seq_length=min(spec.max_position_embeddings, 4096),
        # YaRN is GPTModel's position embedding of its own; under multi-latent attention, MLA's rope type.
        position_embedding_type=position_embedding_type,
        # What Megatron-LM's validation leaves of its default: off beside another position embedding than rope, and
        # off beside sparse attention, where megatron-core refuses it.
        apply_rope_fusion=position_embedding_type == "rope" and spec.sparse_attention is None,
        # Megatron-LM's parser default (--no-position-embedding is deprecated): what its own saves hold, and what a
        # resumption's check_checkpoint_args compares the run's args with. The model reads position_embedding_type.
        add_position_embedding=True,
        use_rotary_position_embeddings=position_embedding_type != "none",
        rotary_base=_integral(spec.rope_theta, "--rotary-base", "rope_theta"),
        rotary_percent=spec.rotary_percent,
        rotary_interleaved=False,
        use_rope_scaling=rope is not None and rope.kind == "llama3",
        rope_scaling_factor=rope.factor if rope is not None and rope.kind == "llama3" else 8.0,
        rotary_seq_len_interpolation_factor=linear_factor,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        norm_epsilon=spec.norm_eps,
        layernorm_zero_centered_gamma=spec.zero_centered_norms,
        apply_layernorm_1p=spec.zero_centered_norms,
        attention_output_gate=spec.attention_output_gate,
        swiglu=spec.activation == "silu",
        squared_relu=spec.activation == "squared_relu",
        quick_geglu=spec.activation == "quick_gelu",
        glu_linear_offset=spec.glu_linear_offset,
        activation_func_clamp_value=spec.activation_clamp,
        softmax_type=spec.softmax_type,
        # Megatron-LM's TEGroupedMLP refuses its default bias-dropout fusion for experts with biases (gpt-oss).
        bias_dropout_fusion=not (spec.linear_bias and spec.moe is not None),
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        # Megatron-LM's --spec: the layer spec function its model builder calls instead of its default one.
        spec=list(QK_NORM_ACROSS_HEADS) if spec.qk_norm_across_heads else None,
        untie_embeddings_and_output_weights=spec.untie_embeddings,
        # Megatron-LM's (left, right) window excludes the position itself; HF's `sliding_window` counts it.
        window_size=(spec.sliding_window - 1, 0) if spec.sliding_window is not None else None,
        # Per layer, 1 where the window applies, where only some layers have it (Megatron numbers them from 1).
        window_attn_skip_freq=[int(windowed) for windowed in spec.sliding_layers] if spec.sliding_layers else None,
        vocab_size=spec.vocab_size,
        padded_vocab_size=padded_vocab_size(spec.vocab_size, par),
        make_vocab_size_divisible_by=par.make_vocab_size_divisible_by,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        **par.pipeline.args(par.pp),
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        bf16=dtype == dtypes.bfloat16,
        fp16=dtype == dtypes.float16,
        params_dtype=dtype,
        # HF models train with the config's attention dropout and no hidden dropout; Megatron-LM's default is 0.1.
        attention_dropout=spec.attention_dropout,
        hidden_dropout=0.0,
        transformer_impl=transformer_impl,
        tokenizer_type="HuggingFaceTokenizer" if has_tokenizer else None,
        tokenizer_model=str(tokenizer_dir.absolute()) if has_tokenizer else None,
        num_experts=None,
        mtp_num_layers=spec.mtp_layers or None,
    )
    if spec.moe is not None:
        moe = spec.moe
        args.update(
            num_experts=moe.num_experts,
            moe_router_topk=moe.top_k,
            moe_ffn_hidden_size=moe.ffn_hidden_size,
            moe_router_pre_softmax=moe.router_pre_softmax,
            moe_layer_freq=1 if all(moe.moe_layers) else [int(is_moe) for is_moe in moe.moe_layers],
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
            # Grouped GEMM experts are TEGroupedMLP under Transformer Engine; the local spec's would be the
            # legacy GroupedMLP (CUDA-only grouped_gemm package), so it gets SequentialMLP. Same checkpoint keys.
            moe_grouped_gemm=transformer_impl == "transformer_engine",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=moe.aux_loss_coeff,
            moe_token_dispatcher_type="alltoall",
        )
        args.update(_router_args(moe))
    if rope is not None and rope.kind == "yarn" and spec.mla is None:
        args.update(
            rotary_scaling_factor=rope.factor,
            yarn_original_max_position_embeddings=rope.original_max_position_embeddings,
            yarn_beta_fast=rope.beta_fast,
            yarn_beta_slow=rope.beta_slow,
            mscale=rope.mscale,
            mscale_all_dim=rope.mscale_all_dim,
            yarn_correction_range_round_to_int=rope.truncate,
        )
    if spec.mla is not None:
        args.update(_mla_args(spec))
    if spec.linear_attention is not None:
        args.update(_linear_attention_args(spec, transformer_impl))
    if spec.sparse_attention is not None:
        args.update(_sparse_attention_args(spec, par, transformer_impl))
    if par.model_class == "hybrid":
        args.update(hybrid_args(args, spec, par))
    return argparse.Namespace(**args)


def _sparse_attention_args(spec: ModelSpec, par: Parallelism, transformer_impl: str) -> dict[str, Any]:
    """DeepSeek Sparse Attention, which megatron-core builds only under the Transformer Engine spec, with sequence
    parallelism at TP > 1 (its absorbed MLA requires it) and without rope fusion (see megatron_args). No Hadamard rotation before scoring (see
    mconvert.mappings.deepseek_v32); the key norm's own epsilon where it differs from the model's; the top-k
    shared as the layers without an indexer say."""
    sparse = spec.sparse_attention
    if transformer_impl != "transformer_engine":
        raise ConversionError(f"--transformer-impl {transformer_impl}: megatron-core builds sparse-attention layers only under transformer_engine")
    freq, offset = shared_top_k_schedule(sparse.indexer_layers) if not all(sparse.indexer_layers) else (1, 0)
    return dict(
        experimental_attention_variant="dsa",
        sequence_parallel=par.tp > 1,
        dsa_indexer_n_heads=sparse.index_heads,
        dsa_indexer_head_dim=sparse.index_head_dim,
        dsa_indexer_topk=sparse.topk,
        dsa_indexer_topk_freq=freq,
        dsa_indexer_skip_topk_offset=offset,
        dsa_indexer_rope_interleaved=sparse.rope_interleaved,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_k_norm_epsilon=sparse.key_norm_eps if sparse.key_norm_eps != spec.norm_eps else None,
    )


def _linear_attention_args(spec: ModelSpec, transformer_impl: str) -> dict[str, Any]:
    """Gated delta-net layers beside full attention. megatron-core builds them only under the Transformer
    Engine spec. Its linear_attention_freq N makes every N-th layer full attention; other patterns are lists,
    1 for a linear-attention layer."""
    la = spec.linear_attention
    if transformer_impl != "transformer_engine":
        raise ConversionError(f"--transformer-impl {transformer_impl}: megatron-core builds gated delta-net layers only under transformer_engine")
    full = [layer for layer, linear in enumerate(la.layers) if not linear]
    every = full[0] + 1 if full else 0
    regular = every > 1 and la.layers == tuple(bool((layer + 1) % every) for layer in range(spec.num_layers))
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=every if regular else [int(linear) for linear in la.layers],
        linear_conv_kernel_dim=la.conv_kernel,
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_num_key_heads=la.key_heads,
        linear_num_value_heads=la.value_heads,
    )


def _router_args(moe: MoESpec) -> dict[str, Any]:
    """DeepSeek-V3 and GLM-4.5 routing: sigmoid scores, an expert bias that only chooses experts, scaled
    weights, group-limited choice, fp32 routing."""
    return dict(
        moe_router_dtype="fp32" if moe.router_fp32 else None,
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
    )


# YaRN settings of multi-latent attention that Megatron-LM's command line cannot set (its --yarn-* flags apply
# to --position-embedding-type yarn only): MLATransformerConfig's fields, with the defaults that megatron-core
# 0.16.1 and Megatron-LM 0.19.2 share. Stored in the args under the fields' names, which Megatron-LM's
# core_transformer_config_from_args copies into MLATransformerConfig when a run's args hold them.
MLA_YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _mla_args(spec: ModelSpec) -> dict[str, Any]:
    """Multi-latent attention. Its latent norms exist only with qk_layernorm; rope is MLA's own (YaRN when the
    model scales it, plain otherwise: an unscaled YaRN needs rotary_scaling_factor 1, not MLA's default 40)."""
    mla, rope = spec.mla, spec.rope_scaling
    if rope is not None and rope.kind != "yarn":
        raise ConversionError(f"rope scaling '{rope.kind}' cannot be expressed with multi-latent attention (yarn can)")
    if rope is not None and not rope.truncate:
        # MLATransformerConfig has no field for it: MLA's YaRN always rounds its correction range.
        raise ConversionError("yarn truncate false cannot be expressed with multi-latent attention")
    return dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_layernorm=True,
        rope_type="yarn" if rope is not None else "rope",
        rotary_scaling_factor=rope.factor if rope is not None else 1.0,
        mscale=rope.mscale if rope is not None else 1.0,
        mscale_all_dim=rope.mscale_all_dim if rope is not None else 0.0,
        **{field: getattr(rope, field) if rope is not None else default for field, default in MLA_YARN_DEFAULTS.items()},
    )


def parallelism_from_args(args: argparse.Namespace) -> Parallelism:
    """The layout a checkpoint was saved with, as its args record it (a HybridModel's pipeline split as the layout
    its pattern's stages are)."""
    hybrid = bool(getattr(args, "hybrid_layer_pattern", None))
    args = gpt_view(args)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    return Parallelism(
        tp=tp,
        pp=getattr(args, "pipeline_model_parallel_size", 1) or 1,
        ep=getattr(args, "expert_model_parallel_size", 1) or 1,
        etp=None if etp in (None, tp) else etp,
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128) or 128,
        pipeline=PipelineSplit.from_args(args),
        model_class="hybrid" if hybrid else "gpt",
    )


