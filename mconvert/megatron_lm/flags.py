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
)
from mconvert.megatron_lm.hybrid_args import gpt_checkpoint_into_hybrid_flags
from mconvert.megatron_lm.settings import BY_ARG, SETTINGS, getter, has_feature
from mconvert.megatron_lm.spec_names import MCONVERT_SPECS


def pipeline_split_flags(split: PipelineSplit) -> list[str]:
    """The split as Megatron-LM's flags (none for the even split)."""
    rows = [(BY_ARG[arg], getattr(split, field)) for field, arg in PipelineSplit.ARGS.items()]
    return [setting.flag_text(value) for setting, value in rows if setting.shown(value, lambda name: None)]


def megatron_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM command-line flags for the model that `args` describe (a MODEL_ARGS block), each value in
    the form Megatron-LM's parser takes, in the settings table's order."""
    get = getter(args)
    return [
        setting.flag_text(value)
        for setting in SETTINGS
        if setting.flag is not None and has_feature(setting, get) and setting.shown(value := get(setting.arg), get)
    ]


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
    builds differently (mconvert.verify.megatron_model.require_unnormalized_mla_query) or older megatron-core fuses
    differently (interleaved rope in packed sequences); and what gated delta-net needs beside megatron-core
    (flash-linear-attention, which refuses its backward on Hopper under some Tritons: it reports wrong gradients
    there)."""
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
    if tuple(getattr(args, "spec", None) or ()) in MCONVERT_SPECS:
        caveats.append(
            f"the layers are built by mconvert's {args.spec[0]} (--spec {args.spec[1]}): install mconvert where "
            "Megatron-LM runs"
        )
    if getattr(args, "rotary_interleaved", False):
        caveats.append(
            "megatron-core 0.16.1 (not 0.19.2) drops --rotary-interleaved in Transformer Engine's fused rope of packed "
            "sequences and rotates the halves of each head there: train packed sequences on it with --no-rope-fusion"
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


