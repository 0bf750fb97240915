"""Megatron-LM itself as the reference (`megatron.training`, shipped with megatron-core >= 0.19 on Python >= 3.12):
its argument parser and validation, the model its `pretrain_gpt.py` builds from those args, and its own
`load_checkpoint`, run on CPU gloo ranks (`mconvert.verify.distributed.run_ranks`).

Functions that build or load run inside a rank, with megatron-core's parallel state set up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# Flags a test or driver adds to MODEL_ARGS + LOAD_ARGS: what a training command line has besides the model.
RUN_FLAGS = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-5"]
# On CPU: the local spec (Transformer Engine needs a GPU), weights made on the CPU, no fused kernels, and the
# token dispatcher that runs on gloo (it moves tokens to their experts and back, the result is the same).
CPU_FLAGS = [
    "--moe-token-dispatcher-type", "allgather",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
]


def script_arrays(checkpoint_dir: Path, *arrays: str) -> list[str]:
    """The words of bash arrays of a checkpoint's megatron_args.sh (MODEL_ARGS, LOAD_ARGS), as bash expands
    them when a launch script sources the file."""
    expand = " ".join(f'"${{{name}[@]}}"' for name in arrays)
    return subprocess.run(
        ["bash", "-c", f'source "$1" && printf "%s\\n" {expand}', "_", str(Path(checkpoint_dir) / "megatron_args.sh")],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()


@contextmanager
def _command_line(argv: list[str], world_size: int, rank: int) -> Iterator[None]:
    """Megatron-LM reads its flags from sys.argv and the world from the environment, as under torchrun."""
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS")}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank))
    # Megatron-LM requires it for TP > 1 on GPUs before Blackwell (which its check is told this is), and unset under
    # FSDP, as train.sh sets it.
    if {"--use-megatron-fsdp", "--use-torch-fsdp2"}.isdisjoint(argv):
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    else:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def parse_megatron_lm_args(argv: list[str], world_size: int, rank: int = 0) -> argparse.Namespace:
    """Megatron-LM's own `parse_args` and `validate_args` on `argv`, as `pretrain_gpt.py` runs them (its
    initialize_megatron), with `--use-checkpoint-args` applied between the two."""
    import torch
    from megatron.training import arguments, checkpointing

    if not torch.cuda.is_available():
        # Validation asks the GPU for its architecture (the CUDA_DEVICE_MAX_CONNECTIONS rule, grouped GEMM's
        # support): on CPU, answer as a Hopper GPU would, which keeps those rules in force.
        arguments.get_device_arch_version = lambda: 9
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
    with _command_line(argv, world_size, rank):
        args = arguments.parse_args()
        if args.use_checkpoint_args:
            checkpointing.load_args_from_checkpoint(args)
        arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args


def build_model_as_pretrain_gpt(args: argparse.Namespace, pre_process: bool, post_process: bool):
    """The GPTModel Megatron-LM's pretrain_gpt.py builds from `args` (its gpt_builders.gpt_builder): the
    TransformerConfig from Megatron-LM's own `core_transformer_config_from_args`, the layer spec it picks, and
    GPTModel's arguments as it passes them: not `--rope-scaling-factor` nor
    `--rotary-seq-len-interpolation-factor` (GPTModel's defaults, 8 and none, apply; see
    mconvert.megatron_lm.flags.pretrain_gpt_caveats)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    from mconvert.verify.cpu_shims import experimental_block_without_te

    config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.spec is not None and args.spec[0] != "local":
        # --spec MODULE FUNCTION: its builder calls the function with gpt_config_from_args's model config.
        from megatron.core.transformer.spec_utils import import_module
        from megatron.training.argument_utils import gpt_config_from_args

        spec = import_module(args.spec)(gpt_config_from_args(args), vp_stage=None)
    elif config.experimental_attention_variant is not None:
        # Megatron-LM's builder takes megatron-core's experimental block spec, which builds gated delta-net and
        # sparse attention only under Transformer Engine; on CPU ranks, the same layers from its local modules.
        if use_te:
            from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
                get_transformer_block_with_experimental_attention_variant_spec,
            )

            spec = get_transformer_block_with_experimental_attention_variant_spec(config=config)
        else:
            spec = experimental_block_without_te(config, args)
    elif args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention
        )
    else:
        spec = get_gpt_layer_local_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            normalization=args.normalization,
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    )


def load_as_megatron_lm(argv: list[str]):
    """In a rank: parse `argv` as Megatron-LM does, build the model as pretrain_gpt.py does (pretrain_hybrid.py, for a
    hybrid layer pattern) and load the checkpoint `--load` names through Megatron-LM's `load_checkpoint`. Returns
    (the model chunks, the args)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import checkpointing, global_vars

    from mconvert.verify.cpu_shims import install_megatron_lm_cpu_shims

    if dist.get_backend() == "gloo":
        install_megatron_lm_cpu_shims()
    args = parse_megatron_lm_args(argv, dist.get_world_size(), dist.get_rank())
    # Builds the tokenizer MODEL_ARGS name, which pads the vocabulary as training does.
    global_vars.set_global_variables(args)
    if getattr(args, "hybrid_layer_pattern", None):
        from mconvert.verify.hybrid_model import build_model_as_pretrain_hybrid as build
    else:
        build = build_model_as_pretrain_gpt
    model = build(args, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
    if dist.get_backend() == "nccl":
        # As Megatron-LM's get_model places the model before loading: Transformer Engine's modules are made on the GPU,
        # plain parameters (a shared expert's gate, mconvert's own layers' norms) on the CPU.
        model.cuda(torch.cuda.current_device())
    checkpointing.load_checkpoint([model], None, None, strict=True)
    model.eval()
    return [model], args
