"""Megatron-LM's command line for a converted model: the MODEL_ARGS and LOAD_ARGS of `megatron_args.sh`, what
`--use-checkpoint-args` would not restore, and where pretrain_gpt.py builds another model than its flags say."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from mconvert.mcore import fsdp_dtensor
from mconvert.mcore.parallelism import PipelineSplit
from mconvert.megatron_lm.args import (
    FLAG_OF_ARG,
    MEGATRON_LM_DEFAULTS,
    MLA_YARN_DEFAULTS,
    RESTORED_BY_CHECKPOINT_ARGS,
    stored_arg,
)
from mconvert.megatron_lm.hybrid_args import gpt_checkpoint_into_hybrid_flags
from mconvert.megatron_lm.spec_names import QK_NORM_ACROSS_HEADS, QK_NORM_ACROSS_HEADS_HYBRID


def pipeline_split_flags(split: PipelineSplit) -> list[str]:
    """The split as Megatron-LM's flags (none for the even split)."""
    flags = []
    for field, arg in PipelineSplit.ARGS.items():
        value, flag = getattr(split, field), "--" + arg.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags.append(f"{flag} {shlex.quote(str(value))}")
    return flags


def megatron_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM command-line flags for the model that `args` describe (a MODEL_ARGS block), each value in
    the form Megatron-LM's parser takes."""
    a = args
    flags = [
        f"--num-layers {a.num_layers}",
        f"--hidden-size {a.hidden_size}",
        f"--ffn-hidden-size {a.ffn_hidden_size}",
        f"--num-attention-heads {a.num_attention_heads}",
        f"--kv-channels {a.kv_channels}",
        f"--max-position-embeddings {a.max_position_embeddings}",
        f"--seq-length {a.seq_length}",
        f"--position-embedding-type {stored_arg(a, 'position_embedding_type', 'rope')}",
        f"--rotary-base {a.rotary_base}",
        "--normalization RMSNorm",
        f"--norm-epsilon {a.layernorm_epsilon:g}",
        "--quick-geglu" if getattr(a, "quick_geglu", False) else "--squared-relu" if getattr(a, "squared_relu", False) else "--swiglu",
        f"--attention-dropout {a.attention_dropout:g}",
        f"--hidden-dropout {a.hidden_dropout:g}",
        f"--vocab-size {a.vocab_size}",
        f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by}",
        f"--tensor-model-parallel-size {a.tensor_model_parallel_size}",
        f"--pipeline-model-parallel-size {a.pipeline_model_parallel_size}",
        *pipeline_split_flags(PipelineSplit.from_args(a)),
        f"--transformer-impl {a.transformer_impl}",
    ]
    if getattr(a, "hybrid_layer_pattern", None):
        flags.append(f"--hybrid-layer-pattern {shlex.quote(a.hybrid_layer_pattern)}")
    if getattr(a, "mamba_num_heads", None):
        flags += [f"--mamba-{name.replace('_', '-')} {getattr(a, 'mamba_' + name)}" for name in ("state_dim", "head_dim", "num_groups", "num_heads")]
    if getattr(a, "sequence_parallel", False):
        flags.append("--sequence-parallel")
    if not getattr(a, "apply_rope_fusion", True) and stored_arg(a, "position_embedding_type", "rope") == "rope":
        flags.append("--no-rope-fusion")  # Megatron-LM turns it off by itself beside other position embeddings
    if a.rotary_percent != 1.0:
        flags.append(f"--rotary-percent {a.rotary_percent:g}")
    if a.group_query_attention:
        flags += ["--group-query-attention", f"--num-query-groups {a.num_query_groups}"]
    if a.use_rope_scaling:
        flags += ["--use-rope-scaling", f"--rope-scaling-factor {a.rope_scaling_factor:g}"]
    if a.rotary_seq_len_interpolation_factor is not None:
        flags.append(f"--rotary-seq-len-interpolation-factor {a.rotary_seq_len_interpolation_factor}")
    if a.window_size is not None:
        flags.append(f"--window-size {a.window_size[0]},{a.window_size[1]}")
    if getattr(a, "window_attn_skip_freq", None) is not None:
        flags.append("--window-attn-skip-freq '" + str(a.window_attn_skip_freq).replace(" ", "") + "'")
    if getattr(a, "softmax_type", "vanilla") != "vanilla":
        flags.append(f"--softmax-type {a.softmax_type}")
    if getattr(a, "glu_linear_offset", 0.0):
        flags.append(f"--glu-linear-offset {a.glu_linear_offset:g}")
    if getattr(a, "activation_func_clamp_value", None) is not None:
        flags.append(f"--activation-func-clamp-value {a.activation_func_clamp_value:g}")
    if stored_arg(a, "position_embedding_type", "rope") == "yarn":
        flags += [
            f"--rotary-scaling-factor {a.rotary_scaling_factor:g}",
            f"--yarn-original-max-position-embeddings {a.yarn_original_max_position_embeddings}",
            f"--yarn-beta-fast {a.yarn_beta_fast:g}",
            f"--yarn-beta-slow {a.yarn_beta_slow:g}",
            f"--mscale {a.mscale:g}",
            f"--mscale-all-dim {a.mscale_all_dim:g}",
            "--yarn-correction-range-round-to-int" if a.yarn_correction_range_round_to_int else "--no-yarn-correction-range-round-to-int",
        ]
    if not a.add_bias_linear:  # biases are Megatron-LM's default: it has no --add-bias-linear
        flags.append("--disable-bias-linear")
    if not getattr(a, "bias_dropout_fusion", True):
        flags.append("--no-bias-dropout-fusion")
    if a.add_qkv_bias and not a.add_bias_linear:
        flags.append("--add-qkv-bias")
    if a.qk_layernorm:
        flags.append("--qk-layernorm")
    if getattr(a, "spec", None):
        flags.append("--spec " + " ".join(a.spec))
    if stored_arg(a, "layernorm_zero_centered_gamma", False):
        flags.append("--apply-layernorm-1p")
    if getattr(a, "attention_output_gate", False):
        flags.append("--attention-output-gate")
    if a.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if a.bf16:
        flags.append("--bf16")
    elif a.fp16:
        flags.append("--fp16")
    if a.tokenizer_type is not None:
        flags += [f"--tokenizer-type {a.tokenizer_type}", f"--tokenizer-model {shlex.quote(a.tokenizer_model)}"]
    if a.num_experts:
        flags += [
            f"--num-experts {a.num_experts}",
            f"--moe-router-topk {a.moe_router_topk}",
            f"--moe-ffn-hidden-size {a.moe_ffn_hidden_size}",
            f"--expert-model-parallel-size {a.expert_model_parallel_size}",
            f"--expert-tensor-parallel-size {a.expert_tensor_parallel_size}",
            f"--moe-router-load-balancing-type {a.moe_router_load_balancing_type}",
            f"--moe-aux-loss-coeff {a.moe_aux_loss_coeff:g}",
            f"--moe-token-dispatcher-type {a.moe_token_dispatcher_type}",
        ]
        if a.moe_grouped_gemm:
            flags.append("--moe-grouped-gemm")
        if a.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if a.moe_layer_freq != 1:
            flags.append("--moe-layer-freq '" + str(a.moe_layer_freq).replace(" ", "") + "'")
        if a.moe_shared_expert_intermediate_size:
            flags.append(f"--moe-shared-expert-intermediate-size {a.moe_shared_expert_intermediate_size}")
        if a.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
        flags += _router_flags(a)
    if getattr(a, "multi_latent_attention", False):
        flags += _mla_flags(a)
    if getattr(a, "mtp_num_layers", None):
        flags.append(f"--mtp-num-layers {a.mtp_num_layers}")
    if getattr(a, "experimental_attention_variant", None) == "gated_delta_net":
        flags += _linear_attention_flags(a)
    if getattr(a, "experimental_attention_variant", None) == "dsa":
        flags += _sparse_attention_flags(a)
    return flags


def _sparse_attention_flags(a: argparse.Namespace) -> list[str]:
    flags = [
        "--experimental-attention-variant dsa",
        f"--dsa-indexer-n-heads {a.dsa_indexer_n_heads}",
        f"--dsa-indexer-head-dim {a.dsa_indexer_head_dim}",
        f"--dsa-indexer-topk {a.dsa_indexer_topk}",
    ]
    if a.dsa_indexer_topk_freq != 1:
        flags += [f"--dsa-indexer-topk-freq {a.dsa_indexer_topk_freq}", f"--dsa-indexer-skip-topk-offset {a.dsa_indexer_skip_topk_offset}"]
    if a.dsa_indexer_rope_interleaved:
        flags.append("--dsa-indexer-rope-interleaved")
    if not a.dsa_indexer_rotate_activation:
        flags.append("--no-dsa-indexer-rotate-activation")
    if a.dsa_indexer_k_norm_epsilon is not None:
        flags.append(f"--dsa-indexer-k-norm-epsilon {a.dsa_indexer_k_norm_epsilon:g}")
    return flags


def _linear_attention_flags(a: argparse.Namespace) -> list[str]:
    freq = a.linear_attention_freq
    return [
        "--experimental-attention-variant gated_delta_net",
        f"--linear-attention-freq {freq}" if isinstance(freq, int) else "--linear-attention-freq '" + str(freq).replace(" ", "") + "'",
        f"--linear-conv-kernel-dim {a.linear_conv_kernel_dim}",
        f"--linear-key-head-dim {a.linear_key_head_dim}",
        f"--linear-value-head-dim {a.linear_value_head_dim}",
        f"--linear-num-key-heads {a.linear_num_key_heads}",
        f"--linear-num-value-heads {a.linear_num_value_heads}",
    ]


def _router_flags(a: argparse.Namespace) -> list[str]:
    flags = []
    if getattr(a, "moe_router_dtype", None) is not None:
        flags.append(f"--moe-router-dtype {a.moe_router_dtype}")
    if a.moe_router_score_function != "softmax":
        flags.append(f"--moe-router-score-function {a.moe_router_score_function}")
    if a.moe_router_enable_expert_bias:
        flags.append("--moe-router-enable-expert-bias")
    if a.moe_router_topk_scaling_factor is not None:
        flags.append(f"--moe-router-topk-scaling-factor {a.moe_router_topk_scaling_factor:g}")
    if a.moe_router_num_groups is not None:
        flags += [f"--moe-router-num-groups {a.moe_router_num_groups}", f"--moe-router-group-topk {a.moe_router_group_topk}"]
    return flags


def _mla_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--multi-latent-attention"]
    if a.q_lora_rank is not None:
        flags.append(f"--q-lora-rank {a.q_lora_rank}")
    flags += [
        f"--kv-lora-rank {a.kv_lora_rank}",
        f"--qk-head-dim {a.qk_head_dim}",
        f"--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim}",
        f"--v-head-dim {a.v_head_dim}",
        f"--rope-type {a.rope_type}",
        f"--rotary-scaling-factor {a.rotary_scaling_factor:g}",
        f"--mscale {a.mscale:g}",
        f"--mscale-all-dim {a.mscale_all_dim:g}",
    ]
    return flags


TRAINING_SCRIPTS = {"gpt": "pretrain_gpt.py", "hybrid": "pretrain_hybrid.py"}


def training_script(args: argparse.Namespace) -> str:
    """Megatron-LM's training script for the model class the args describe."""
    return TRAINING_SCRIPTS["hybrid" if getattr(args, "hybrid_layer_pattern", None) else "gpt"]


def load_flags(checkpoint_dir: Path, ckpt_format: str = "torch_dist") -> list[str]:
    """The flags that start training from a converted checkpoint: its weights only, no optimizer or RNG state.

    An fsdp_dtensor checkpoint (mconvert.mcore.fsdp_dtensor) is loaded by a Megatron-FSDP run alone, and as the
    resumption of a run at iteration 0: Megatron-LM 0.19.2 stops one started with --finetune or --no-load-optim
    (in bf16 it then copies the weights into the optimizer's main parameters, which Megatron-FSDP does not
    implement: NotImplementedError), and its strict load of a resumption wants every optimizer and scheduler
    setting the checkpoint would hold. With --no-strict-fsdp-dtensor-load it loads what the checkpoint holds and
    leaves the rest as the run made it."""
    load = f"--load {shlex.quote(str(checkpoint_dir.absolute()))}"
    if ckpt_format == fsdp_dtensor.FORMAT:
        return [load, "--use-megatron-fsdp", f"--ckpt-format {ckpt_format}", "--no-strict-fsdp-dtensor-load",
                "--no-load-rng"]
    return [load, f"--ckpt-format {ckpt_format}", "--finetune", "--no-load-optim", "--no-load-rng"]


def not_restored_by_checkpoint_args(args: argparse.Namespace) -> list[str]:
    """The flags of this model's MODEL_ARGS whose args Megatron-LM's `--use-checkpoint-args` would leave at defaults
    other than the model's values: what a run relying on it alone would silently get wrong."""
    printed = {flag.split(" ")[0] for flag in megatron_flags(args)}
    return [
        flag
        for name, default in MEGATRON_LM_DEFAULTS.items()
        if name not in RESTORED_BY_CHECKPOINT_ARGS and getattr(args, name, default) != default
        and (flag := FLAG_OF_ARG.get(name, "--" + name.replace("_", "-"))) in printed
    ]


def unnormalized_mla_query(args: argparse.Namespace) -> bool:
    """Multi-latent attention without a query bottleneck (q_lora_rank null: DeepSeek-V2-Lite) but with q/k layer
    norms (MLA's latent kv norm): the query is projected straight from the layer's input, which megatron-core 0.19
    cannot build (mconvert.verify.megatron_model.require_unnormalized_mla_query)."""
    return bool(getattr(args, "multi_latent_attention", False) and args.q_lora_rank is None and getattr(args, "qk_layernorm", False))


def pretrain_gpt_caveats(args: argparse.Namespace) -> list[str]:
    """What Megatron-LM's pretrain_gpt.py would build differently from these args: its model builder
    (gpt_builders.gpt_builder) passes GPTModel neither --rope-scaling-factor nor
    --rotary-seq-len-interpolation-factor, so GPTModel's defaults (8, none) apply; what recent megatron-core
    builds differently (mconvert.verify.megatron_model.require_unnormalized_mla_query); and what gated delta-net
    needs beside megatron-core (flash-linear-attention, which refuses its backward on Hopper under some Tritons:
    it reports wrong gradients there)."""
    caveats = []
    if args.use_rope_scaling and args.rope_scaling_factor != 8.0:
        caveats.append(
            f"pretrain_gpt.py builds GPTModel without --rope-scaling-factor, so with factor 8, not "
            f"{args.rope_scaling_factor:g}: pass rope_scaling_factor=args.rope_scaling_factor in its gpt_builder"
        )
    if args.rotary_seq_len_interpolation_factor is not None and not getattr(args, "hybrid_layer_pattern", None):
        caveats.append(
            "pretrain_gpt.py builds GPTModel without --rotary-seq-len-interpolation-factor, so without position "
            "interpolation: pass seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor in its gpt_builder"
        )
    if getattr(args, "experimental_attention_variant", None) == "gated_delta_net":
        caveats.append(
            "gated delta-net layers import flash-linear-attention (pip install flash-linear-attention), whose delta-rule "
            "backward refuses Hopper GPUs under Triton 3.4 to 3.7.0 (it reports wrong gradients there): train with Triton 3.7.1 or "
            "later, with tilelang installed, or with --deterministic-mode (megatron-core's PyTorch delta rule)"
        )
    if getattr(args, "experimental_attention_variant", None) == "dsa":
        caveats.append(
            "sparse attention's indexer chooses tokens without a gradient: it trains only through its own loss "
            "(--dsa-indexer-loss-coeff), else it keeps its converted weights; its Hadamard rotation is off "
            "(--no-dsa-indexer-rotate-activation: orthogonal, no score changes; drop the flag to rotate, in bf16 with "
            "fast-hadamard-transform)"
        )
    if tuple(getattr(args, "spec", None) or ()) in (QK_NORM_ACROSS_HEADS, QK_NORM_ACROSS_HEADS_HYBRID):
        caveats.append(
            f"the layers' q/k norms across heads are built by mconvert's {args.spec[0]} (--spec): install mconvert "
            "where Megatron-LM runs"
        )
    if unnormalized_mla_query(args):
        caveats.append(
            "megatron-core 0.19 and later add a layer norm before linear_q_proj in multi-latent attention without "
            "--q-lora-rank, which this model does not have: train it with megatron-core 0.13 to 0.18"
        )
    return caveats


def settings_without_flags(args: argparse.Namespace) -> list[str]:
    """Settings of this model that megatron-core takes but Megatron-LM 0.19.2's command line cannot set, each with
    how to set it. Its core_transformer_config_from_args copies every arg named as a field of the config class
    into the config, so an arg set under the field's name before the model is built reaches it."""
    if not getattr(args, "multi_latent_attention", False) or args.rope_type != "yarn":
        return []
    fields = {field: getattr(args, field, default) for field, default in MLA_YARN_DEFAULTS.items()}
    differing = {field: value for field, value in fields.items() if value != MLA_YARN_DEFAULTS[field]}
    if not differing:
        return []
    settings = ", ".join(f"{field}={value:g}" for field, value in differing.items())
    assignments = "; ".join(f"args.{field} = {value:g}" for field, value in differing.items())
    them = "it" if len(differing) == 1 else "them"
    return [
        f"YaRN's {settings}: Megatron-LM's command line has no flag for {them} under --multi-latent-attention "
        f"(its --yarn-* flags apply to --position-embedding-type yarn only), and without {them} the model is built "
        f"with MLATransformerConfig's {', '.join(f'{field}={MLA_YARN_DEFAULTS[field]:g}' for field in differing)}. "
        f"Set MLATransformerConfig({settings}) with megatron-core or Megatron-Bridge; in Megatron-LM, set "
        f"{assignments} in pretrain_gpt.py between parse_and_validate_args and gpt_config_from_args (which copies "
        f"every arg named as an MLATransformerConfig field into it). This checkpoint's stored args hold {them}"
    ]


def args_script(args: argparse.Namespace, checkpoint_dir: Path) -> str:
    """megatron_args.sh: MODEL_ARGS (the model) and LOAD_ARGS (start from this checkpoint), for bash."""
    missed = not_restored_by_checkpoint_args(args)
    lines = [f"# Megatron-LM flags for the converted model: pass \"${{MODEL_ARGS[@]}}\" \"${{LOAD_ARGS[@]}}\" to {training_script(args)}."]
    lines += [f"# Caveat: {caveat}." for caveat in pretrain_gpt_caveats(args)]
    lines += [f"# Not settable by Megatron-LM's flags: {setting}." for setting in settings_without_flags(args)]
    if missed:
        lines.append(
            "# Pass MODEL_ARGS even with --use-checkpoint-args: Megatron-LM does not restore "
            + ", ".join(missed) + " from a checkpoint."
        )
    lines += ["MODEL_ARGS=("] + [f"    {flag}" for flag in megatron_flags(args)] + [")"]
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    lines += ["LOAD_ARGS=("] + [f"    {flag}" for flag in load_flags(checkpoint_dir, ckpt_format)] + [")"]
    if ckpt_format == "torch_dist" and (hybrid_flags := gpt_checkpoint_into_hybrid_flags(args)) is not None:
        lines.append(
            "# As a HybridModel (each layer's attention and MLP layers of their own), which Megatron-LM's load makes of "
            "this GPT checkpoint by itself: pass \"${MODEL_ARGS[@]}\" \"${HYBRID_ARGS[@]}\" \"${LOAD_ARGS[@]}\" to pretrain_hybrid.py."
        )
        lines += ["HYBRID_ARGS=("] + [f"    {flag}" for flag in hybrid_flags] + [")"]
    return "\n".join(lines) + "\n"


