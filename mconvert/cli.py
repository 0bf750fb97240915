"""mconvert's command line: `mconvert hf-to-mcore`, `mconvert mcore-to-hf`, `mconvert verify`."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from mconvert.errors import ConversionError, MissingDependency

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _dtype(name: str | None):
    if name is None:
        return None
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", "--target-pipeline-parallel-size", dest="pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", "--target-expert-parallel-size", dest="ep", type=int, default=1, help="expert parallel size")
    parser.add_argument(
        "--etp", "--target-expert-tensor-parallel-size", dest="etp", type=int, default=None,
        help="expert tensor parallel size (default: the same as --tp, as in Megatron)",
    )


def _hf_to_mcore(options: argparse.Namespace) -> int:
    from pathlib import Path

    from mconvert.converters import megatron
    from mconvert.converters.hf_to_mcore import ARGS_SCRIPT, convert_hf_to_mcore
    from mconvert.converters.megatron import Parallelism

    started = time.perf_counter()
    parallelism = Parallelism(
        options.tp, options.pp, options.ep, options.etp, options.make_vocab_size_divisible_by
    )
    result = convert_hf_to_mcore(
        options.load_dir,
        options.save_dir,
        parallelism=parallelism,
        model_size=options.model_size,
        dtype=_dtype(options.dtype),
        transformer_impl=options.transformer_impl,
        overwrite=options.overwrite,
        mtp=not options.no_mtp,
        allow_nonfinite=options.allow_nonfinite,
        progress=lambda message: print(message, file=sys.stderr),
    )
    plan = result.plan
    if result.dropped_mtp_layers:
        print(f"left out {result.dropped_mtp_layers} multi-token prediction layer(s) of {options.load_dir} (--no-mtp)")
    elif plan.spec.mtp_layers:
        print(f"converted {plan.spec.mtp_layers} multi-token prediction layer(s) (--mtp-num-layers; --no-mtp leaves them out)")
    print(
        f"wrote {options.save_dir}: {plan.family.name}, {len(plan.shapes)} tensors, "
        f"TP={parallelism.tp} PP={parallelism.pp} EP={parallelism.ep}, {str(plan.dtype).removeprefix('torch.')}, "
        f"{time.perf_counter() - started:.1f}s"
    )
    # The same text as the file, so that what is printed and what is sourced never differ.
    print(f"Megatron-LM flags (also in {options.save_dir}/{ARGS_SCRIPT}):")
    print(megatron.args_script(result.args, Path(options.save_dir)), end="")
    return 0


def _mcore_to_hf(options: argparse.Namespace) -> int:
    from mconvert.converters.mcore_to_hf import convert_mcore_to_hf

    started = time.perf_counter()
    result = convert_mcore_to_hf(
        options.load_dir,
        options.save_dir,
        iteration=options.iteration,
        hf_config_dir=options.hf_config,
        model_size=options.model_size,
        dtype=_dtype(options.dtype),
        max_shard_size=options.max_shard_size,
        overwrite=options.overwrite,
        progress=lambda message: print(message, file=sys.stderr),
    )
    plan = result.plan
    print(
        f"wrote {options.save_dir}: {plan.family.name} ({result.config['architectures'][0]}), "
        f"{len(plan.hf_shapes())} tensors, {str(plan.dtype).removeprefix('torch.')}, "
        f"{time.perf_counter() - started:.1f}s"
    )
    return 0


def _verify(options: argparse.Namespace) -> int:
    import json
    import os
    import warnings
    from pathlib import Path

    # megatron-core and torch warn about optional kernels they fall back from, in every rank: noise here.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")

    from mconvert.converters.megatron import Parallelism
    from mconvert.verify.run import ArchitectureMismatch, VerifyRequest, verify

    request = VerifyRequest(
        hf_dir=Path(options.hf),
        mcore_dir=Path(options.mcore),
        parallelism=Parallelism(options.tp, options.pp, options.ep, options.etp),
        device=options.device,
        dtype=options.dtype,
        prompts_file=Path(options.prompts) if options.prompts else None,
        timeout_s=options.timeout,
        spec=options.spec,
    )
    try:
        report = verify(request)
    except ConversionError as error:
        print(f"mconvert verify: error: {error}", file=sys.stderr)
        return 2
    except ArchitectureMismatch as mismatch:
        print(f"mconvert verify: FAIL: the checkpoint is not the HF model: {mismatch}", file=sys.stderr)
        return 1
    print(report.table())
    if options.json:
        Path(options.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mconvert", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    to_mcore = commands.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core torch_dist checkpoint")
    to_mcore.add_argument("--load-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    to_mcore.add_argument("--save-dir", required=True, help="where to write the torch_dist checkpoint")
    to_mcore.add_argument("--model-size", default=None, help="Megatron-LM's --model-size (llama2-7B, llama3, mistral, qwen2.5, ...) or a family name (qwen3, ...); read from config.json when absent")
    _add_parallel_flags(to_mcore)
    to_mcore.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="stored dtype (default: config.json's)")
    to_mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="as Megatron-LM's flag (default 128)")
    to_mcore.add_argument(
        "--transformer-impl", choices=("transformer_engine", "local"), default="transformer_engine",
        help="the layer spec the checkpoint is meant for (recorded in its args; both specs load it)",
    )
    to_mcore.add_argument(
        "--no-mtp", action="store_true",
        help="leave out the multi-token prediction layers the checkpoint holds (DeepSeek-V3, GLM-4.5)",
    )
    to_mcore.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists")
    to_mcore.add_argument(
        "--allow-nonfinite", action="store_true", help="convert weights holding NaN or Inf (an error by default)"
    )
    to_mcore.set_defaults(run=_hf_to_mcore)

    to_hf = commands.add_parser("mcore-to-hf", help="Megatron-Core torch_dist (or legacy torch) checkpoint -> HF safetensors")
    to_hf.add_argument("--load-dir", required=True, help="Megatron checkpoint directory (with latest_checkpointed_iteration.txt)")
    to_hf.add_argument("--save-dir", required=True, help="where to write the HF model directory")
    to_hf.add_argument("--iteration", type=int, default=None, help="the iter_NNNNNNN to convert (default: the tracker file's)")
    to_hf.add_argument(
        "--hf-config", default=None, metavar="REF_DIR",
        help="an HF model directory of this architecture: its config.json is the base of the written one, its "
        "generation config and tokenizer files are copied (needed when the checkpoint stores no args)",
    )
    to_hf.add_argument(
        "--model-size", default=None,
        help="the family, as hf-to-mcore's --model-size names it; must agree with the checkpoint (default: told from its args)",
    )
    to_hf.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="written dtype (default: the checkpoint's)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    to_hf.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists")
    to_hf.set_defaults(run=_mcore_to_hf)

    check = commands.add_parser("verify", help="compare the HF model's logits with the converted Megatron-Core model's")
    check.add_argument("--hf", required=True, help="HF checkpoint directory")
    check.add_argument("--mcore", required=True, help="torch_dist checkpoint directory")
    _add_parallel_flags(check)
    check.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="GPUs through NCCL, or CPU gloo ranks")
    check.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype both models run in")
    check.add_argument("--prompts", default=None, help="text file, one prompt a line (needs a tokenizer in --hf)")
    check.add_argument(
        "--spec", choices=("te", "local"), default=None,
        help="megatron-core layer spec: te (Transformer Engine, grouped-GEMM experts for MoE; GPUs only) or local "
        "(default: te when transformer_engine imports, else local)",
    )
    check.add_argument("--json", default=None, help="write the report as JSON here")
    check.add_argument("--timeout", type=float, default=1800.0, help="seconds before ranks are stopped (never hang)")
    check.set_defaults(run=_verify)
    return parser


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signum)


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    # SIGTERM (kill's, a scheduler's) unwinds as Ctrl-C does, so that what a conversion half wrote is removed.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return options.run(options)
    except MissingDependency as error:
        print(f"mconvert: error: {error}", file=sys.stderr)
        return 2
    except ConversionError as error:
        print(f"mconvert: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        signum = interrupt.args[0] if interrupt.args else signal.SIGINT
        print(f"mconvert: interrupted by {signal.Signals(signum).name}; no output was kept", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
