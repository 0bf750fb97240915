"""Megatron-LM's args for a model: the Namespace written into common.pt (what `--use-checkpoint-args` reads),
made from a ModelSpec by the settings table (mconvert.megatron_lm.settings); how stored args are read across
Megatron-LM versions; which args its `--use-checkpoint-args` restores."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore.parallelism import Parallelism, PipelineSplit
from mconvert.megatron_lm.hybrid_args import gpt_view, hybrid_args
from mconvert.megatron_lm.setting import Target
from mconvert.megatron_lm.settings import FEATURES, SETTINGS
from mconvert.megatron_lm.spec_names import GEMMA3_SLIDING_WINDOW_ROPE_THETA

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
# Megatron-LM's parser defaults of the args that shape the model (not the run's: layout, dtype, tokenizer): the model
# a run builds from a flag left out. tests/megatron_lm checks every row of the table against its parser.
MEGATRON_LM_DEFAULTS: dict[str, Any] = {s.arg: s.default for s in SETTINGS if s.flag is not None and not s.run}
FLAG_OF_ARG = {s.arg: s.flag_name for s in SETTINGS if s.flag is not None}
# Args whose name in Megatron-LM 0.19 (its parser's dest, after TransformerConfig's field) differs from the name
# earlier Megatron-LM versions store: both names are written, either is read.
RENAMED_ARGS = {s.arg: s.stored_as for s in SETTINGS if s.stored_as is not None}
# Multi-latent attention's YaRN settings that Megatron-LM's command line cannot set, with their defaults.
MLA_YARN_DEFAULTS = {s.arg: s.default for s in SETTINGS if s.feature == ("mla",) and s.flag is None}
# Files that make an HF directory usable as Megatron-LM's `--tokenizer-model` for HuggingFaceTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def stored_arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """An arg as stored by any Megatron-LM version (by its 0.19 name, or the earlier one), else `default`."""
    value = getattr(args, name, None)
    if value is None and name in RENAMED_ARGS:
        value = getattr(args, RENAMED_ARGS[name], None)
    return default if value is None else value


def megatron_args(
    spec: ModelSpec, par: Parallelism, dtype: Any, transformer_impl: str, tokenizer_dir: Path | None = None
) -> argparse.Namespace:
    """The Megatron-LM arguments that describe the model, as `--use-checkpoint-args` reads them from common.pt.
    `dtype`: the weights' (numpy's or torch's; params_dtype holds numpy's). `tokenizer_dir`: the HF directory,
    recorded as the tokenizer when it has tokenizer files."""
    _refuse_inexpressible(spec, transformer_impl)
    has_tokenizer = tokenizer_dir is not None and any((tokenizer_dir / name).exists() for name in TOKENIZER_FILES)
    target = Target(par, dtypes.dtype_of(dtype), transformer_impl, tokenizer_dir if has_tokenizer else None)
    args: dict[str, Any] = {}
    for setting in SETTINGS:  # those of features the model lacks left out; each under every name it is stored by
        if not setting.feature or any(FEATURES[name][0](spec, target) for name in setting.feature):
            args[setting.arg] = setting.write(spec, target)
            if setting.stored_as is not None:
                args[setting.stored_as] = args[setting.arg]
    if par.model_class == "hybrid":
        args.update(hybrid_args(args, spec, par))
    return argparse.Namespace(**args)


def _refuse_inexpressible(spec: ModelSpec, transformer_impl: str) -> None:
    """What Megatron-LM's args cannot say of this model: multi-latent attention's rope other than YaRN, or YaRN
    without its rounded correction range (MLATransformerConfig has no field for it); gated delta-net and sparse
    attention outside Transformer Engine, the only spec megatron-core builds them under."""
    rope = spec.rope_scaling
    if spec.mla is not None and rope is not None and rope.kind != "yarn":
        raise ConversionError(f"rope scaling '{rope.kind}' cannot be expressed with multi-latent attention (yarn can)")
    if spec.mla is not None and rope is not None and not rope.truncate:
        raise ConversionError("yarn truncate false cannot be expressed with multi-latent attention")
    for feature, what in ((spec.linear_attention, "gated delta-net"), (spec.sparse_attention, "sparse-attention")):
        if feature is not None and transformer_impl != "transformer_engine":
            raise ConversionError(f"--transformer-impl {transformer_impl}: megatron-core builds {what} layers only under transformer_engine")
    _refuse_outside_gemma3_layers(spec)


def _refuse_outside_gemma3_layers(spec: ModelSpec) -> None:
    """Norms before and after the sublayers, a GeGLU with GELU's tanh approximation and a rope of the sliding-window
    layers' own are what mconvert's Gemma 3 layer spec builds, together: none can be said apart from the others to
    Megatron-LM (its flags name no such activation, and the spec takes no value from them: its sliding-window layers'
    rope has theta 10000)."""
    gemma3 = spec.norms_before_sublayers and spec.norms_after_sublayers
    theta = spec.sliding_window_rope_theta
    if gemma3 and spec.activation != "gelu_tanh" or spec.activation == "gelu_tanh" and not gemma3:
        raise ConversionError(
            f"{spec.activation} MLPs {'beside' if gemma3 else 'without'} norms before and after the sublayers: Megatron-LM's "
            "flags name no GeGLU with tanh-GELU, which mconvert's Gemma 3 layer spec builds with those norms only"
        )
    if theta is not None and (not gemma3 or theta != GEMMA3_SLIDING_WINDOW_ROPE_THETA):
        raise ConversionError(
            f"sliding-window layers with rope theta {theta:g} of their own: megatron-core has one rope a model (GPTModel's), "
            f"and mconvert's Gemma 3 layer spec gives those layers theta {GEMMA3_SLIDING_WINDOW_ROPE_THETA:g}, as every "
            "Gemma 3 release has (Megatron-LM's command line can give a layer spec no other)"
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


