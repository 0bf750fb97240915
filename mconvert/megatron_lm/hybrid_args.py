"""Megatron-LM's args for a HybridModel checkpoint (pretrain_hybrid.py), from a GPT model's args, and back.

HybridModel numbers its layers by sub-block, so whatever Megatron-LM indexes by layer number changes with it
(Megatron-LM's hybrid-model migration guide, 0.19): the layer count doubles, per-layer lists spread over the
pattern (an attention schedule's values at the attention positions), the MoE and linear-attention schedules
become the pattern's `E` and `G`, and its `|` separators replace the pipeline split's flags."""

from __future__ import annotations

import argparse
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore import hybrid
from mconvert.mcore.parallelism import Parallelism, PipelineSplit
from mconvert.megatron_lm.spec_names import HYBRID_STACKS

# Megatron-LM's --spec for HybridModel's default (Transformer Engine) stack, as its migration guide passes it.
HYBRID_STACK_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]


def hybrid_args(args: dict[str, Any], spec: ModelSpec, par: Parallelism) -> dict[str, Any]:
    """`args` (a GPT model's, as megatron_args makes them) for the same model as a HybridModel."""
    if args["use_rope_scaling"]:
        raise ConversionError("--model-class hybrid: HybridModel takes no llama3 rope scaling (megatron-core 0.19.2); convert with --model-class gpt")
    if args["rotary_interleaved"]:
        # Its RotaryEmbedding lays the frequencies out for the two halves while the rotation takes neighbouring pairs.
        raise ConversionError(
            "--model-class hybrid: HybridModel builds its rope without rotary_interleaved (megatron-core 0.16.1 to "
            "0.19.2), so it would not rotate this model's pairs of dims; convert with --model-class gpt"
        )
    if args.get("spec") and tuple(args["spec"]) not in HYBRID_STACKS:
        raise ConversionError(f"--model-class hybrid: mconvert's layer spec {args['spec'][1]} has no HybridModel stack; convert with --model-class gpt")
    pattern = hybrid.hybrid_pattern(spec, par.pipeline.stage_layers(par.pp, spec.num_layers))
    updates: dict[str, Any] = dict(
        hybrid_layer_pattern=pattern,
        num_layers=hybrid.blocks_per_layer(spec) * spec.num_layers,
        spec=list(HYBRID_STACKS[tuple(args["spec"])]) if args.get("spec") else HYBRID_STACK_SPEC,
        # The pattern's `|` separators are the split (virtual stages included), which Megatron-LM takes no flag beside.
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        pipeline_model_parallel_layout=None,
    )
    if args.get("moe_layer_freq") is not None:
        updates["moe_layer_freq"] = 1  # the pattern's E
    if isinstance(args.get("window_attn_skip_freq"), list):
        updates["window_attn_skip_freq"] = hybrid.per_hybrid_layer(args["window_attn_skip_freq"], pattern)
    if args.get("experimental_attention_variant") == "gated_delta_net":
        updates["linear_attention_freq"] = [int(symbol == hybrid.GATED_DELTA_NET) for symbol in hybrid.split_pattern(pattern)[0]]
    if args.get("dsa_indexer_topk_freq", 1) != 1:
        updates.update(hybrid_shared_top_k(args["dsa_indexer_topk_freq"], args["dsa_indexer_skip_topk_offset"]))
    return updates


def hybrid_shared_top_k(freq: int, offset: int) -> dict[str, int]:
    """Sparse attention's shared top-k schedule over HybridModel's numbers: GPT layer n is hybrid layer 2n - 1, so
    megatron-core's rule (layer n computes its top-k when max(n - offset, 0) % freq == 0) keeps its layers with
    twice the frequency and the offset 2 x offset - 1, which must not be negative."""
    if offset < 1:
        raise ConversionError(
            f"--model-class hybrid: sparse attention's top-k shared every {freq} layers from the first cannot be numbered "
            "by HybridModel's layers (its offset would be -1); convert with --model-class gpt"
        )
    return dict(dsa_indexer_topk_freq=2 * freq, dsa_indexer_skip_topk_offset=2 * offset - 1)


def gpt_view(args: argparse.Namespace, source: str = "args") -> argparse.Namespace:
    """A HybridModel checkpoint's args as the GPT model's (hybrid_args undone); other args unchanged."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        return args
    if hybrid.has_mamba(pattern):
        return _block_view(args, pattern)
    main, mtp = hybrid.gpt_layers_of(pattern, source)
    attention, mlp = main[0::2], main[1::2]
    view = argparse.Namespace(**vars(args))
    view.num_layers = len(attention)
    view.mtp_num_layers = len(mtp) or None
    view.decoder_first_pipeline_num_layers = view.decoder_last_pipeline_num_layers = None
    stages = pattern.split(hybrid.MTP_SEPARATOR)[0].split(hybrid.PIPE)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    view.pipeline_model_parallel_layout = PipelineSplit.of_stages([len(stage) // 2 for stage in stages], pp, len(mtp)).layout
    if hybrid.MOE in mlp:  # as megatron_args writes it: 1 where every layer is MoE
        view.moe_layer_freq = 1 if set(mlp) == {hybrid.MOE} else [int(symbol == hybrid.MOE) for symbol in mlp]
    if isinstance(getattr(args, "window_attn_skip_freq", None), list):
        view.window_attn_skip_freq = hybrid.per_gpt_layer(args.window_attn_skip_freq, pattern)
    if hybrid.GATED_DELTA_NET in attention:
        view.experimental_attention_variant = "gated_delta_net"
        view.linear_attention_freq = [int(symbol == hybrid.GATED_DELTA_NET) for symbol in attention]
    if hybrid.SPARSE_ATTENTION in attention:
        view.experimental_attention_variant = "dsa"
        freq = getattr(args, "dsa_indexer_topk_freq", 1) or 1
        if freq != 1:
            view.dsa_indexer_topk_freq = freq // 2
            view.dsa_indexer_skip_topk_offset = (args.dsa_indexer_skip_topk_offset + 1) // 2
    if hybrid.MLA in attention or hybrid.SPARSE_ATTENTION in attention:
        view.multi_latent_attention = True
    stack = tuple(getattr(args, "spec", None) or ())
    gpt_specs = {tuple(HYBRID_STACK_SPEC): None, **{hybrid: list(gpt) for gpt, hybrid in HYBRID_STACKS.items()}}
    view.spec = gpt_specs.get(stack, getattr(args, "spec", None))
    return view


def _block_view(args: argparse.Namespace, pattern: str) -> argparse.Namespace:
    """The args of a model whose every hybrid layer is one HF layer (Mamba layers beside the others): its layers, MTP
    layers, MoE schedule and pipeline stages as the pattern says them; `layer_blocks` and `mtp_blocks`
    (spec_from_args) read the pattern itself."""
    main, mtp = hybrid.split_pattern(pattern)
    if any(part != mtp[0] for part in mtp):
        raise ConversionError(f"args: hybrid_layer_pattern {pattern!r}: MTP layers of different blocks")
    view = argparse.Namespace(**vars(args))
    view.num_layers = len(main)
    view.mtp_num_layers = len(mtp) or None
    view.decoder_first_pipeline_num_layers = view.decoder_last_pipeline_num_layers = None
    stages = pattern.split(hybrid.MTP_SEPARATOR)[0].split(hybrid.PIPE)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    view.pipeline_model_parallel_layout = PipelineSplit.of_stages([len(stage) for stage in stages], pp, len(mtp)).layout
    if hybrid.MOE in main:
        view.moe_layer_freq = [int(symbol == hybrid.MOE) for symbol in main]
    if tuple(getattr(args, "spec", None) or ()) == tuple(HYBRID_STACK_SPEC):
        view.spec = None
    return view


def gpt_checkpoint_into_hybrid_flags(args: argparse.Namespace) -> list[str] | None:
    """The flags that, beside a GPT checkpoint's MODEL_ARGS, start a HybridModel run (pretrain_hybrid.py) from it:
    Megatron-LM 0.19's load translates a GPT checkpoint's layers itself (gpt_checkpoint_interop) where each is
    standard attention and one kind of MLP, without MTP. None where it cannot: other attention, mixed MLPs, MTP,
    and what HybridModel does not build (llama3 rope scaling, interleaved rope, mconvert's own layer spec) or whose
    flags would contradict the pattern's stages (an uneven pipeline split)."""
    unsupported = (
        getattr(args, "multi_latent_attention", False), getattr(args, "experimental_attention_variant", None),
        getattr(args, "moe_layer_freq", 1) != 1, getattr(args, "mtp_num_layers", None), args.use_rope_scaling,
        getattr(args, "rotary_interleaved", False),
        getattr(args, "spec", None), getattr(args, "hybrid_layer_pattern", None),
        *(getattr(args, arg, None) for arg in PipelineSplit.ARGS.values()),
    )
    if any(unsupported):
        return None
    pattern = (hybrid.ATTENTION + (hybrid.MOE if args.num_experts else hybrid.MLP)) * args.num_layers
    flags = [f"--hybrid-layer-pattern '{pattern}'", "--spec " + " ".join(HYBRID_STACK_SPEC)]
    if isinstance(getattr(args, "window_attn_skip_freq", None), list):
        flags.append("--window-attn-skip-freq '" + str(hybrid.per_hybrid_layer(args.window_attn_skip_freq, pattern)).replace(" ", "") + "'")
    return flags
