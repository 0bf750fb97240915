"""mconvert's command line: `mconvert hf-to-mcore`, `mconvert mcore-to-hf`, `mconvert adapter-to-hf`, `mconvert verify`, `mconvert inspect`."""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

from mconvert import __version__
from mconvert.adapter_in_command import add_adapter_commands
from mconvert.errors import ConversionError, MissingDependency

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _dtype(name: str | None):
    if name is None:
        return None
    from mconvert.dtypes import BY_NAME

    return BY_NAME[DTYPE_NAMES[name]]


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", "--target-pipeline-parallel-size", dest="pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", "--target-expert-parallel-size", dest="ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", "--target-expert-tensor-parallel-size", dest="etp", type=int, default=None,
                        help="expert tensor parallel size (default: the same as --tp, as in Megatron)")
    split = parser.add_argument_group(
        "pipeline split", "how Megatron-LM splits the layers over the --pp stages, as its own flags say (default: evenly)"
    )
    split.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, metavar="N", help="layers of the first stage")
    split.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, metavar="N", help="layers of the last stage")
    split.add_argument("--account-for-embedding-in-pipeline-split", action="store_true", help="count the embedding as a layer")
    split.add_argument("--account-for-loss-in-pipeline-split", action="store_true", help="count the loss as a layer")
    split.add_argument(
        "--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
        help='each stage\'s layers, e.g. "Et*3|(tt|)*29,m|L" (E embedding, t decoder layer, m MTP layer, L loss)',
    )


def _parallelism(options: argparse.Namespace):
    """The layout `_add_parallel_flags`'s flags ask for (the split's flags are Megatron-LM's, dests and all)."""
    from mconvert.mcore.parallelism import Parallelism, PipelineSplit

    return Parallelism(
        options.tp, options.pp, options.ep, options.etp,
        make_vocab_size_divisible_by=getattr(options, "make_vocab_size_divisible_by", 128),
        pipeline=PipelineSplit.from_args(options),
        model_class=getattr(options, "model_class", "gpt"),
    )


def _add_workers_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None, help="threads converting at once (default: one per core, up to 8, as memory "
                        "allows; a quantized weight's work is spread over every core besides); under torchrun, per rank")


def _first_rank() -> bool:
    """Whether this process prints the summary: torchrun's ranks each convert a share, rank 0 speaks for all."""
    from mconvert.converters.parallel import torchrun_rank
    return torchrun_rank()[0] == 0


def _hf_to_mcore(options: argparse.Namespace) -> int:
    from mconvert.converters.bridge_layout import MEGATRON_BRIDGE, next_steps
    from mconvert.converters.hf_to_mcore import ARGS_SCRIPT, convert_hf_to_mcore, mtp_left_out
    from mconvert.converters.progress import progress_for, summary
    from mconvert.hub import resolve_hf_dir
    from mconvert.mappings import how_read
    from mconvert.megatron_lm.flags import args_script, pipeline_split_flags
    from mconvert.megatron_lm.launch import SBATCH_SCRIPT, TORCHRUN_SCRIPT

    started = time.perf_counter()
    load_dir = resolve_hf_dir(options.load_dir, "--load-dir", revision=options.revision)
    save_dir = Path(options.save_dir)
    parallelism = _parallelism(options)
    progress = progress_for("hf-to-mcore", options.quiet)
    try:
        result = convert_hf_to_mcore(
            load_dir,
            save_dir,
            parallelism=parallelism,
            model_size=options.model_size,
            dtype=_dtype(options.dtype),
            transformer_impl=options.transformer_impl,
            overwrite=options.overwrite,
            mtp=not options.no_mtp,
            allow_nonfinite=options.allow_nonfinite,
            ckpt_format=options.format,
            layout=options.layout,
            workers=options.workers,
            progress=progress,
        )
    finally:
        progress.close()
    if not _first_rank():
        return 0
    plan = result.plan
    if (read_as := how_read(plan.spec.hf_config)) is not None:
        print(read_as)
    for what, count in result.left_out:
        print(f"left out {what} of {options.load_dir}: {count} tensors a Megatron language-model checkpoint does not hold")
    for difference in plan.spec.computed_differently:
        print(f"note: {difference}")
    if shifted := plan.shifted_in_16_bits():
        dtype = plan.dtype.name
        print(f"note: Megatron's norms multiply by 1 + w, so {shifted[0]} and {len(shifted) - 1} more are stored as w - 1: in "
              f"{dtype} a weight outside [0.5, 2] rounds by its last bit, as Megatron's own {dtype} parameter would; "
              f"--dtype fp32 stores each exactly")
    if result.narrowed:
        (first, wider), dtype = result.narrowed[0], plan.dtype.name
        print(f"note: {first} and {len(result.narrowed) - 1} more are {wider.name} in "
              f"{options.load_dir} and stored in {dtype}, the checkpoint's dtype, as Megatron's own {dtype} parameters "
              f"hold them: their values round; --dtype fp32 stores each exactly")
    if result.mtp_not_held:
        field, named = result.mtp_not_held
        print(f"note: config.json's {field} says {named} multi-token prediction layer(s), which {options.load_dir} does not "
              f"hold (transformers drops them when it saves a model): converted without them")
    if result.dropped_mtp_layers:
        why = mtp_left_out(plan.family, parallelism) or "--no-mtp"
        print(f"left out {result.dropped_mtp_layers} multi-token prediction layer(s) of {options.load_dir} ({why})")
    elif plan.spec.mtp_layers:
        print(f"converted {plan.spec.mtp_layers} multi-token prediction layer(s) (--mtp-num-layers; --no-mtp leaves them out)")
    print(
        f"wrote {save_dir}: {plan.family.name}, {result.tensors} tensors, "
        f"{options.format} for TP={parallelism.tp} PP={parallelism.pp} EP={parallelism.ep}, {plan.dtype.name}, "
        + summary(started, load_dir, save_dir)
    )
    if options.layout == MEGATRON_BRIDGE:
        print(next_steps(save_dir, parallelism, plan.family.name))
        return 0
    # The same text as the file, so that what is printed and what is sourced never differ.
    print(f"Megatron-LM flags (also in {save_dir}/{ARGS_SCRIPT}):")
    print(args_script(result.args, Path(save_dir)), end="")
    print("next:")
    etp = [f"--etp {parallelism.etp}"] if parallelism.etp is not None else []
    layout = " ".join([f"--tp {parallelism.tp} --pp {parallelism.pp} --ep {parallelism.ep}", *etp, *pipeline_split_flags(parallelism.pipeline)])
    needs = "; HybridModel: megatron-core 0.19 or later" if parallelism.model_class == "hybrid" else ""
    if options.format == "torch_dist":  # megatron-core's models load no FSDP format outside an FSDP run
        print(f"  mconvert verify --hf {options.load_dir} --mcore {save_dir} {layout} --device cuda  # --device cpu without GPUs{needs}")
    print(f"  MEGATRON_LM=/path/to/Megatron-LM bash {save_dir}/{TORCHRUN_SCRIPT}      # train on this node")
    print(f"  MEGATRON_LM=/path/to/Megatron-LM sbatch {save_dir}/{SBATCH_SCRIPT}  # or on a Slurm cluster")
    return 0


def _mcore_to_hf(options: argparse.Namespace) -> int:
    from mconvert.converters.fsdp_saves import FSDP_FORMATS
    from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
    from mconvert.converters.quantized_export import AS_SOURCE
    from mconvert.converters.progress import progress_for, summary
    from mconvert.hub import resolve_hf_dir
    from mconvert.mcore.checkpoint import iteration_dir

    started = time.perf_counter()
    hf_config = (resolve_hf_dir(options.hf_config, "--hf-config", weights=False, revision=options.revision)
                 if options.hf_config is not None else None)
    save_dir = Path(options.save_dir)
    progress = progress_for("mcore-to-hf", options.quiet)
    try:
        result = convert_mcore_to_hf(
            options.load_dir,
            save_dir,
            iteration=options.iteration,
            hf_config_dir=hf_config,
            model_size=options.model_size,
            dtype=_dtype(options.dtype),
            **({"max_shard_size": options.max_shard_size} if options.max_shard_size is not None else {}),
            overwrite=options.overwrite, workers=options.workers,
            progress=progress, quantize=options.quantize, adapter=options.adapter,
        )
    finally:
        progress.close()
    if not _first_rank():
        return 0
    plan, run = result.plan, result.run
    beside = "the save's vision tower" if result.saved_beside else "copied from --hf-config"
    print(
        f"wrote {save_dir}: {plan.family.name} ({result.config['architectures'][0]}), "
        f"{result.tensors} tensors{f' ({result.copied} of them {beside})' if result.copied else ''}, "
        f"{plan.dtype.name}{f', the LoRA adapter of {options.adapter} merged in' if options.adapter else ''}, "
        + summary(started, iteration_dir(run.load_dir, run.iteration), save_dir)
    )
    print(*result.notes, sep="\n")  # what the export's tensors were checked against, what it left out
    if result.quantized:
        given = f"as {options.hf_config} stores them" if options.quantize == AS_SOURCE else "in DeepSeek-V3's FP8 release format"
        print(f"wrote {result.quantized} tensors {result.quantized_as}, and the quantization_config, {given}")
    elif result.dequantized:
        print(f"wrote the weights unquantized: config.json leaves out the quantization_config of {options.hf_config}")
    print("next:")
    # megatron-core's models load FSDP saves only in FSDP runs.
    if result.source_format not in FSDP_FORMATS and options.adapter is None:  # merged, it is not the checkpoint's model
        needs = "; HybridModel: megatron-core 0.19 or later" if plan.parallelism.model_class == "hybrid" else ""
        print(f"  mconvert verify --hf {save_dir} --mcore {options.load_dir} --device cuda  # --device cpu without GPUs{needs}")
    print(f"  mconvert inspect --check {save_dir}")
    return 0


def _inspect(options: argparse.Namespace) -> int:
    from mconvert.hub import resolve_hf_dir
    from mconvert.inspection import run_inspect

    hf_config = resolve_hf_dir(options.hf_config, "--hf-config", weights=False) if options.hf_config is not None else None
    return run_inspect(Path(options.path), options.json, options.check, hf_config)


def _verify(options: argparse.Namespace) -> int:
    import json
    import os
    import warnings

    # megatron-core and torch warn about optional kernels they fall back from, in every rank: noise here.
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")

    from mconvert.hub import resolve_hf_dir
    from mconvert.verify.run import ArchitectureMismatch, VerifyRequest, verify

    try:
        request = VerifyRequest(
            hf_dir=resolve_hf_dir(options.hf, "--hf", revision=options.revision),
            mcore_dir=Path(options.mcore),
            parallelism=_parallelism(options),
            device=options.device,
            dtype=options.dtype,
            prompts_file=Path(options.prompts) if options.prompts else None,
            timeout_s=options.timeout,
            spec=options.spec,
        )
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
    from mconvert.converters.bridge_layout import LAYOUTS

    parser = argparse.ArgumentParser(prog="mconvert", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mconvert {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    to_mcore = commands.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core torch_dist checkpoint")
    to_mcore.add_argument("--load-dir", required=True, help="HF checkpoint directory (config.json + safetensors), or a hub id (Qwen/Qwen2.5-7B) found in the hub cache or downloaded")
    to_mcore.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    to_mcore.add_argument("--save-dir", required=True, help="where to write the torch_dist checkpoint")
    to_mcore.add_argument("--model-size", default=None, help="Megatron-LM's --model-size (llama2-7B, llama3, mistral, qwen2.5, ...) or a family name (qwen3, ...); read from config.json when absent")
    _add_parallel_flags(to_mcore)
    to_mcore.add_argument(
        "--model-class", choices=("gpt", "hybrid"), default="gpt",
        help="the Megatron-Core model the checkpoint is for: gpt (GPTModel, pretrain_gpt.py) or hybrid (HybridModel, "
        "pretrain_hybrid.py: each layer's attention and MLP layers of their own, as --hybrid-layer-pattern names them)",
    )
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
    to_mcore.add_argument("--format", choices=("torch_dist", "fsdp_dtensor"), default="torch_dist",
                          help="torch_dist (default; what DDP and FSDP2 runs load), or fsdp_dtensor for a Megatron-FSDP "
                          "run (--use-megatron-fsdp)")
    to_mcore.add_argument("--layout", choices=LAYOUTS, default=LAYOUTS[0], help="megatron-lm (default: megatron-core's "
                          "keys, Megatron-LM's args and launch scripts), or megatron-bridge: Megatron-Bridge's Qwen3.5 "
                          "vision-language model (language model and vision tower) and its run_config.yaml")
    to_mcore.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists")
    _add_workers_flag(to_mcore)
    to_mcore.add_argument(
        "--allow-nonfinite", action="store_true", help="convert weights holding NaN or Inf (an error by default)"
    )
    to_mcore.add_argument("--quiet", action="store_true", help="no progress, only the summary")
    to_mcore.set_defaults(run=_hf_to_mcore)

    to_hf = commands.add_parser("mcore-to-hf", help="Megatron-Core torch_dist (or legacy torch, fsdp_dtensor, torch_dcp) checkpoint -> HF safetensors")
    to_hf.add_argument("--load-dir", required=True, help="Megatron checkpoint directory (with latest_checkpointed_iteration.txt), or the top folder of a verl or NeMo-RL run")
    to_hf.add_argument("--save-dir", required=True, help="where to write the HF model directory")
    to_hf.add_argument("--iteration", type=int, default=None, help="the iter_NNNNNNN to convert (default: the tracker file's)")
    to_hf.add_argument(
        "--hf-config", default=None, metavar="REF_DIR",
        help="an HF model directory (or hub id) of this architecture: its config.json is the base of the written one, its "
        "generation config and tokenizer files are copied (needed when the checkpoint stores no args), experts written as it stores them",
    )
    to_hf.add_argument("--revision", default=None, help="branch, tag or commit of a --hf-config hub id")
    to_hf.add_argument("--model-size", default=None, help="the family, as hf-to-mcore's --model-size names it; must agree with the checkpoint (default: told from its args)")
    to_hf.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="written dtype (default: the checkpoint's)")
    to_hf.add_argument("--max-shard-size", default=None, help="largest safetensors file (default 2GB: each file is hashed on one core, so files of a few GB finish together where many workers convert)")
    to_hf.add_argument("--quantize", default=None, help="as-source: write the tensors that the --hf-config checkpoint stores quantized (FP8 blocks, INT4, MXFP4) so again, with its quantization_config; fp8-block: write the decoder's linear layers in FP8 (e4m3, an fp32 weight_scale_inv per 128x128 block) as DeepSeek-V3's release does, whatever the source; fp8-block-ue8m0: the same with power-of-two scales (scale_fmt ue8m0, DeepSeek-V3.1's) (default: unquantized)")
    to_hf.add_argument("--adapter", default=None, metavar="ADAPTER_DIR", help="a Megatron-Bridge LoRA adapter save to merge in: W + alpha/dim B A in fp32, rounded once")
    to_hf.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists")
    _add_workers_flag(to_hf)
    to_hf.add_argument("--quiet", action="store_true", help="no progress, only the summary")
    to_hf.set_defaults(run=_mcore_to_hf)
    add_adapter_commands(commands)

    show = commands.add_parser("inspect", help="what a checkpoint holds (HF, torch_dist or legacy torch), or --check it against its manifest")
    show.add_argument("path", help="checkpoint directory")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument("--check", action="store_true", help="re-read every file against the sha256 manifest a conversion wrote")
    show.add_argument("--hf-config", default=None, metavar="HF_DIR",
                      help="for a Megatron save whose args (or tool's records) do not describe the model: the HF folder of the model it was trained from")
    show.set_defaults(run=_inspect)

    check = commands.add_parser("verify", help="compare the HF model's logits with the converted Megatron-Core model's")
    check.add_argument("--hf", required=True, help="HF checkpoint directory, or a hub id")
    check.add_argument("--revision", default=None, help="branch, tag or commit of a --hf hub id")
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
    return _execute(build_parser().parse_args(argv))


def _execute(options: argparse.Namespace, first: Callable[[], None] = lambda: None) -> int:
    """Run the parsed command (after `first`), its errors and interruptions as one line and an exit code."""
    # SIGTERM (kill's, a scheduler's) unwinds as Ctrl-C does, so that what a conversion half wrote is removed.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        first()
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


def _import_torch_frozen() -> None:
    """Import torch (after checking verify's packages: a conversion-only install has none) with the garbage collector
    off and freeze what it made (about a million objects): later full collections walked them all for nothing."""
    from mconvert.dependencies import VERIFY, VERIFY_INSTALL, require

    require(VERIFY, "mconvert verify", VERIFY_INSTALL)
    gc.disable()
    try:
        import torch  # noqa: F401

        gc.freeze()
    finally:
        gc.enable()


def run() -> NoReturn:
    """The `mconvert` command (and `python -m mconvert`): main, with torch imported out of the garbage collector's way
    (`_import_torch_frozen`) by verify (no other command imports torch outside torchrun), and what is left at exit
    frozen too: the interpreter's last collection walked torch's objects once more, 0.35-0.4 s of every run on a
    2-core box (files are closed and renamed by then; the standard streams are flushed at exit as before)."""
    options = build_parser().parse_args()  # --help, --version and usage errors exit here, before any import
    code = _execute(options, first=_import_torch_frozen if options.run is _verify else (lambda: None))
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
