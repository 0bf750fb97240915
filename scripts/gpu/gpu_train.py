"""Megatron-LM training steps from converted checkpoints, on GPUs, checked against transformers.

    python scripts/gpu/gpu_train.py --work /tmp/gt --out results/ qwen2.5-0.5b:tp2 qwen2.5-0.5b:pp2 qwen3-30b-a3b@2:ep2

A job is MODEL:LAYOUT as in scripts/gpu/gpu_verify.py. For each: a random-init HF model of that shape (bf16; with
--mtp also the multi-token prediction layers its config names, which transformers does not build),
`mconvert hf-to-mcore --dtype fp32` at the layout, a token file of --rows rows (one global batch), then two
runs of `torchrun scripts/training/megatron_train.py` with exactly the checkpoint's MODEL_ARGS (from megatron_args.sh)
plus the load, data and optimizer flags (with `--launcher train.sh`: two runs of the train.sh the conversion
wrote, MEGATRON_LM naming a folder whose pretrain_gpt.py is that driver, the schedule in its environment):
- --lr 0 for 2 steps with --save (and the expert bias's update off, where the model has one): its loss must
  equal transformers' and its training save must export to the HF input bit for bit;
- --lr LR for --steps steps: its loss must fall at every step
(with --model-class hybrid, the conversion writes a HybridModel checkpoint; with --hybrid-args, the runs add
megatron_args.sh's HYBRID_ARGS, which train the GPT checkpoint as a HybridModel; with --distributed-optimizer, both add --use-distributed-optimizer: the save holds that optimizer's state; with
--fsdp megatron, both run Megatron-FSDP (--use-megatron-fsdp), with --fsdp torch PyTorch's FSDP2
(--use-torch-fsdp2), saving as --ckpt-format says; --from-scratch: see its help; with --format fsdp_dtensor, the
conversion is Megatron-FSDP's format and the runs load it with its LOAD_ARGS, as every run does);
then scripts/training/megatron_train_check.py checks them. Without Transformer Engine (it does not import) MODEL_ARGS'
`--transformer-impl transformer_engine` cannot run; the local spec is added then, with what Megatron-LM's
defaults take from TE turned off, and the result says so. Dropout is off (--hidden-dropout 0
--attention-dropout 0; Megatron-LM defaults both to 0.1, the HF models to 0) so that the training forward is
the model's function. Each result is appended to OUT/train.jsonl as it comes; jobs not started before
--deadline-s are skipped (exit 3; with --done-dir a later run does only those), runs are stopped at it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))
sys.path.insert(0, str(REPO / "scripts" / "training"))

import torch  # noqa: E402
from gpu_verify import parse_job, write_hf_model  # noqa: E402
from megatron_train_check import write_tokens  # noqa: E402

from mconvert.synthetic import add_mtp_layers  # noqa: E402
from mconvert.verify.megatron_lm import script_arrays  # noqa: E402

# Megatron-LM's FSDP wrappers: the flags of each run. Megatron-FSDP saves and loads fsdp_dtensor alone (it cannot
# load a torch_dist checkpoint: --format fsdp_dtensor, or --from-scratch); FSDP2 takes torch_dist or torch_dcp
# (--ckpt-format).
FSDP = {
    "megatron": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
    "torch": ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"],
}
# What Megatron-LM's defaults take from Transformer Engine, off for the local spec.
WITHOUT_TE = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]


# Under --deterministic-mode Megatron-LM runs megatron-core's PyTorch gated delta rule; the check's transformers then
# runs its own PyTorch one (flash-linear-attention hidden from it) rather than fla's Triton kernels, whose fp32 differs
# from PyTorch's by a KL of about 5e-4 on either side (scripts/gpu/gdn_kernels.py).
PYTORCH_DELTA_RULE = ["-c", "import runpy, sys; sys.modules['fla'] = None; sys.argv = sys.argv[1:]; "
                            "runpy.run_path(sys.argv[0], run_name='__main__')"]


def stated_settings(ckpt: Path) -> list[str]:
    """The assignments megatron_args.sh's "Not settable by Megatron-LM's flags" lines say to make in
    pretrain_gpt.py, as the driver's --config-field options: the run then builds what a user who followed them
    builds."""
    lines = [line for line in (ckpt / "megatron_args.sh").read_text().splitlines() if line.startswith("# Not settable")]
    return [f"--config-field={name}={value}" for line in lines for name, value in re.findall(r"args\.(\w+) = ([0-9.e+-]+)", line)]


def for_this_machine(flags: list[str], have_te: bool) -> list[str]:
    """A checkpoint's printed flags with what this GPU machine lacks said as flags: without Transformer Engine the
    local spec; without APEX no gradient accumulation fusion."""
    if not have_te:
        return [flag for flag in flags if flag != "--moe-grouped-gemm"] + WITHOUT_TE
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        # Megatron-LM's default gradient accumulation fusion is APEX's CUDA extension (seen missing on the GPU
        # machine: its first training forward stopped there; its output layer refuses to be built without it).
        return [*flags, "--no-gradient-accumulation-fusion"]
    return flags


def torchrun(options, ckpt: Path, have_te: bool, data: list[str], lr: float, iters: int, save: Path | None,
             loss_log: Path) -> tuple[list[str], dict[str, str]]:
    """The driver under torchrun with MODEL_ARGS and the load flags, as the README's commands run it."""
    flags = for_this_machine(script_arrays(ckpt, "MODEL_ARGS", *(["HYBRID_ARGS"] if options.hybrid_args else [])), have_te)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(options.nproc),
        "scripts/training/megatron_train.py", *flags, *stated_settings(ckpt),
        # The conversion's own LOAD_ARGS, as a user passes them.
        *(["--ckpt-format", "torch_dist"] if options.from_scratch else script_arrays(ckpt, "LOAD_ARGS")),
        "--micro-batch-size", str(options.micro_batch_size), "--global-batch-size", str(options.rows),
        "--lr", str(lr), "--train-iters", str(iters), "--loss-log", str(loss_log), *data,
    ]
    if save:
        command += ["--save", str(save), "--save-interval", "1000"]
    return command, {}


def train_sh(options, ckpt: Path, have_te: bool, data: list[str], lr: float, iters: int, save: Path | None,
             loss_log: Path) -> tuple[list[str], dict[str, str]]:
    """The checkpoint's own train.sh, as a user runs it: MEGATRON_LM names a folder whose pretrain_gpt.py is
    the driver, the schedule comes from its environment variables, the data flags last."""
    megatron_lm = options.work / "megatron-lm"
    megatron_lm.mkdir(exist_ok=True)
    if not (megatron_lm / "pretrain_gpt.py").exists():
        (megatron_lm / "pretrain_gpt.py").symlink_to(REPO / "scripts" / "training" / "megatron_train.py")
    env = {
        "MEGATRON_LM": str(megatron_lm), "GPUS_PER_NODE": str(options.nproc), "TRAIN_ITERS": str(iters),
        "MICRO_BATCH_SIZE": str(options.micro_batch_size), "GLOBAL_BATCH_SIZE": str(options.rows),
        "LR": str(lr), "MIN_LR": str(lr), "SAVE_DIR": str(save or loss_log.with_name(loss_log.name + "-save")),
        "MASTER_PORT": "29511",
    }
    # Without TE, what Megatron-LM's defaults take from it goes last (a MoE model's --moe-grouped-gemm stays).
    return ["bash", str(ckpt / "train.sh"), "--loss-log", str(loss_log), *data, *([] if have_te else WITHOUT_TE)], env


def take_out_keys(ckpt: Path, pattern: str) -> int:
    """Take the keys matching `pattern` out of the .metadata of the checkpoint's iteration; how many there were."""
    import pickle

    (metadata_file,) = ckpt.glob("*/.metadata")
    metadata = pickle.loads(metadata_file.read_bytes())
    gone = [key for key in metadata.state_dict_metadata if re.search(pattern, key)]
    for key in gone:
        del metadata.state_dict_metadata[key]
    metadata.storage_data = {index: data for index, data in metadata.storage_data.items() if index.fqn not in gone}
    metadata_file.write_bytes(pickle.dumps(metadata))
    return len(gone)


def run(command: list[str], timeout_s: float, log: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=max(timeout_s, 1), cwd=REPO,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, round(time.perf_counter() - started, 1)


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jobs", nargs="+")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="rows of the token file = --global-batch-size")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=4, help="steps of the run at --lr (0: no such run)")
    parser.add_argument("--done-dir", type=Path, help="a marker per finished job here; jobs marked are skipped")
    parser.add_argument("--megatron-flag", action="append", default=[],
                        help="a flag added to both runs (--megatron-flag=--deterministic-mode), recorded in the result")
    parser.add_argument("--mtp", action="store_true",
                        help="give each HF model the multi-token prediction layers its config names, as the hub's hold them")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="train with --use-distributed-optimizer, as most Megatron-LM runs do: its saves hold the "
                             "optimizer state in that optimizer's sharded form")
    parser.add_argument("--fsdp", choices=sorted(FSDP), help="train under Megatron-FSDP or FSDP2 (see above)")
    parser.add_argument("--ckpt-format", help="the runs' --ckpt-format, where not torch_dist (FSDP2's torch_dcp)")
    parser.add_argument("--format", choices=("torch_dist", "fsdp_dtensor"), default="torch_dist",
                        help="hf-to-mcore's --format: fsdp_dtensor for a Megatron-FSDP run (with --fsdp megatron)")
    parser.add_argument("--without-keys", metavar="REGEX",
                        help="an injected fault: the conversion's DCP keys matching REGEX taken out of its .metadata")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the conversion's (and so the run's) dtype; Megatron-FSDP loads a SwiGLU model only in bf16")
    parser.add_argument("--from-scratch", action="store_true",
                        help="train from Megatron-LM's random init, not the converted checkpoint (for formats that no "
                             "conversion writes): its save is exported and transformers' loss is that of the export (the "
                             "--lr 0 run of this or of --fsdp dumps its weights: --dump-weights)")
    parser.add_argument("--keep-saves", type=Path,
                        help="copy each job's HF model and --lr 0 save here (JOB/hf, JOB/save; at EP above 1 the experts "
                             "each expert-parallel rank dumped, JOB/experts) before they are removed")
    parser.add_argument("--model-class", choices=("gpt", "hybrid"), default="gpt", help="hf-to-mcore's --model-class")
    parser.add_argument("--hybrid-args", action="store_true",
                        help="run a GPT checkpoint as a HybridModel, with megatron_args.sh's HYBRID_ARGS beside MODEL_ARGS")
    parser.add_argument("--launcher", choices=("torchrun", "train.sh"), default="torchrun",
                        help="the driver under torchrun with MODEL_ARGS, or the train.sh the conversion wrote")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    have_te = importlib.util.find_spec("transformer_engine") is not None
    started = time.perf_counter()

    def left() -> float:
        return options.deadline_s - (time.perf_counter() - started)

    skipped = 0
    for job in options.jobs:
        variant = ("-mtp" if options.mtp else "") + ("-distopt" if options.distributed_optimizer else "")
        variant += f"-{options.fsdp}-fsdp" if options.fsdp else ""
        variant += ("-scratch" if options.from_scratch else "") + ("-bf16" if options.dtype == "bf16" else "")
        variant += f"-{options.ckpt_format}" if options.ckpt_format else ""
        variant += f"-{options.format}" if options.format != "torch_dist" else ""
        variant += "-without-" + hashlib.sha1(options.without_keys.encode()).hexdigest()[:6] if options.without_keys else ""
        variant += ("-hybrid" if options.model_class == "hybrid" else "") + ("-hybrid-args" if options.hybrid_args else "")
        name = f"{options.launcher}{variant}-{job.replace(':', '-')}"
        # A job's name may outgrow a file name: its marker is named by a digest.
        digest = hashlib.sha1(name.encode()).hexdigest()[:16]
        marker = options.done_dir / f"train-{digest}" if options.done_dir else None
        if marker and marker.exists():
            print(f"skipped {job}: done in an earlier run", flush=True)
            continue
        if left() < 60:
            print(f"skipped {job}: deadline", flush=True)
            skipped += 1
            continue
        model, sizes, _ = parse_job(job)
        tag = f"{model.split('+')[0]}{variant}-{'-'.join(f'{k}{v}' for k, v in sizes.items())}-{digest[:8]}"
        work = options.work / tag
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        # One HF model per model (and MTP), shared by its jobs; named by a digest where its fields make it long.
        hf_name = model + "+mtp" if options.mtp else model
        hf = options.work / (hf_name if len(hf_name) < 100 else f"{model.split('+')[0]}-{hashlib.sha1(hf_name.encode()).hexdigest()[:16]}")
        result: dict = {"job": job, "launcher": options.launcher, "transformer_engine": have_te, "mtp": options.mtp,
                        "megatron_flags": options.megatron_flag,
                        "distributed_optimizer": options.distributed_optimizer, "fsdp": options.fsdp,
                        "dtype": options.dtype, "from_scratch": options.from_scratch, "ckpt_format": options.ckpt_format,
                        "model_class": options.model_class, "hybrid_args": options.hybrid_args, "format": options.format,
                        "without_keys": options.without_keys}
        result["make_hf_s"] = write_hf_model(model, hf, "cuda" if torch.cuda.is_available() else "cpu")
        if options.mtp and not (hf / "mtp.safetensors").exists():
            add_mtp_layers(hf)
        ckpt = work / "mcore"
        code, result["convert_s"] = run(
            [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(ckpt),
             "--dtype", options.dtype, "--model-class", options.model_class, "--format", options.format,
             *(f"--{k}={v}" for k, v in sizes.items())],
            left(), work / "convert.log",
        )
        if not code and options.without_keys:
            result["keys_taken_out"] = take_out_keys(ckpt, options.without_keys)
        if code:
            result.update(passed=False, convert_output=tail(work / "convert.log"))
        else:
            result["model_args"] = script_arrays(ckpt, "MODEL_ARGS", *(["HYBRID_ARGS"] if options.hybrid_args else []))
            write_tokens(hf, options.rows, options.seq_length, work / "tokens.npy")
            # Data, schedule and a training forward that is the model's function (no dropout), for both launchers.
            data = [
                "--tokenizer-type", "NullTokenizer", "--token-file", str(work / "tokens.npy"),
                "--seq-length", str(options.seq_length), "--hidden-dropout", "0", "--attention-dropout", "0",
                "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--lr-decay-style", "constant",
                "--dist-ckpt-strictness", "raise_unexpected",
                *(["--use-distributed-optimizer"] if options.distributed_optimizer else []),
                *(FSDP[options.fsdp] if options.fsdp else []),
                *(["--ckpt-format", options.ckpt_format] if options.ckpt_format else []),
                *options.megatron_flag,
            ]
            launch = train_sh if options.launcher == "train.sh" else torchrun
            # Megatron moves DeepSeek-V3's and GLM-4.5's expert bias by the token counts after every step
            # (aux-loss-free balancing, --moe-router-bias-update-rate 1e-3), whatever the learning rate: at lr 0
            # it is frozen too, so that the weights stay those converted (measured: step 2's loss moved by 3e-4 to
            # 9e-4 and the save's bias differed, with the update on).
            frozen = ["--moe-router-bias-update-rate", "0"] if "--moe-router-enable-expert-bias" in result["model_args"] else []
            # Under FSDP the weights the run starts from are dumped too: Megatron-FSDP's load skips, unsaid, any name
            # it does not find in the checkpoint, which only they show.
            # One process only: at data-parallel size 2 under Megatron-FSDP the first step's gathering of the sharded
            # weights hung (both ranks waiting in NCCL, measured twice). Megatron's init does not depend on the
            # data-parallel size, so a one-GPU run's dump of the same job holds a larger run's save too.
            # At EP above 1 each expert-parallel rank dumps its own experts (no gather: --dump-local-experts), which
            # differ from the one-GPU run's: each expert-parallel rank draws its own.
            dump = []
            if (options.from_scratch or options.fsdp) and options.nproc == 1:
                dump = ["--dump-weights", str(work / "weights.pt")]
            elif (options.from_scratch or options.fsdp) and int(sizes.get("ep", 1)) > 1:
                dump = ["--dump-local-experts", str(work / "experts")]
            lr0 = launch(options, ckpt, have_te, data + frozen + dump, lr=0.0, iters=2, save=work / "save0", loss_log=work / "log0")
            trained = launch(options, ckpt, have_te, data, lr=options.lr, iters=options.steps, save=None, loss_log=work / "log1")
            result["command_lr0"] = " ".join(f"{k}={shlex.quote(v)}" for k, v in lr0[1].items()) + " " + shlex.join(lr0[0])
            code0, result["lr0_s"] = run(lr0[0], min(left(), 300), work / "lr0.log", lr0[1])
            code1, result["trained_s"] = (None, 0.0)
            if options.steps and left() > 45:
                code1, result["trained_s"] = run(trained[0], min(left(), 300), work / "trained.log", trained[1])
            result.update(lr0_exit=code0, trained_exit=code1)
            reference = hf
            if options.from_scratch and code0 == 0:
                # The run's own weights, as mcore-to-hf reads them from its save: transformers' loss is theirs.
                reference = work / "exported"
                code, result["export_s"] = run(
                    [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(work / "save0"), "--save-dir",
                     str(reference), "--hf-config", str(hf), "--dtype", "fp32"], left(), work / "export.log")
                result["export_exit"] = code
            check = [sys.executable, *(PYTORCH_DELTA_RULE if "--deterministic-mode" in options.megatron_flag else []),
                     "scripts/training/megatron_train_check.py", "check", "--hf", str(reference), "--tokens",
                     str(work / "tokens.npy"), "--out", str(work / "check.json")]
            if (work / "log0").exists():
                check += ["--lr0-log", str(work / "log0")]
            if code0 == 0 and not options.from_scratch:
                check += ["--lr0-save", str(work / "save0")]
            if (work / "log1").exists():
                check += ["--trained-log", str(work / "log1")]
            code, result["check_s"] = run(check, max(left(), 60), work / "check.log")
            if (work / "check.json").exists():
                result["check"] = json.loads((work / "check.json").read_text())
            result["passed"] = code == 0 and code0 == 0 and (code1 == 0 or not options.steps)
            if not result["passed"]:
                result.update(lr0_log=tail(work / "lr0.log"), trained_log=tail(work / "trained.log"),
                              check_log=tail(work / "check.log"), export_log=tail(work / "export.log"))
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_log")}, indent=1), flush=True)
        with open(options.out / "train.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        if options.keep_saves and (work / "save0").exists():
            kept = options.keep_saves / tag
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(hf, kept / "hf")
            shutil.copytree(work / "save0", kept / "save")
            for kept_file in ("tokens.npy", "weights.pt", "weights.pt.error", "check.json"):
                if (work / kept_file).exists():
                    shutil.copy(work / kept_file, kept / kept_file)
            shutil.copytree(work / "log0", kept / "log0", dirs_exist_ok=True)
            if (work / "experts").exists():
                shutil.copytree(work / "experts", kept / "experts", dirs_exist_ok=True)
            (kept / "job.json").write_text(json.dumps({k: result.get(k) for k in ("job", "fsdp", "mtp", "model_args", "command_lr0")}))
        shutil.rmtree(work / "mcore", ignore_errors=True)
        shutil.rmtree(work / "save0", ignore_errors=True)
        shutil.rmtree(work / "log1-save", ignore_errors=True)
        if marker:
            marker.touch()
    return 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
