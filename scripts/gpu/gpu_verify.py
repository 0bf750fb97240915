"""Evidence on GPUs: random-init models of real shapes, converted on the CPU and verified on GPUs.

    python scripts/gpu/gpu_verify.py --work /tmp/gv --out results/ qwen3-8b:tp1 qwen3-8b:tp2 qwen3-30b-a3b@8:ep2

A job is MODEL:LAYOUT[:DTYPE]: MODEL a config of mconvert/configs as CONFIG[@LAYERS][+FIELD=VALUE...] (LAYERS to
cut the model to its first few layers, all if absent; fields of the config set, e.g.
deepseek-v3@2+first_k_dense_replace=1 for its first dense and first MoE layer), LAYOUT like tp1, tp2, pp2, ep2,
tp2pp2, tp2ep2etp1, or WRITTEN>LOADED (tp2ep2>tp1: converted at TP 2 and EP 2, verified at TP 1, as torch_dist
reshards on loading), DTYPE fp32 (default) or bf16. --spec te|local is passed to verify, --model-class to hf-to-mcore. For each job it writes the HF model once (bf16, tensor by tensor; with --quantized, the weights the hub
quantizes as its config's quantization_config says: FP8 blocks, MXFP4), converts it with `mconvert hf-to-mcore` in
DTYPE (a bf16 checkpoint holds some zero-centred norms only rounded, which an fp32 comparison would count against
it) and runs `mconvert verify --device cuda`, timing both; each result is appended to OUT/results.jsonl as it comes,
so a run stopped at its time limit keeps what it finished. Jobs not started before --deadline-s are skipped.
Jobs of one model should be adjacent: the HF model is deleted after its last adjacent job, each checkpoint
after its verify.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mconvert.full_size import write_random_hf_checkpoint  # noqa: E402
from mconvert.synthetic import make_hf_checkpoint, model_config  # noqa: E402

MCONVERT = [sys.executable, "-m", "mconvert.cli"]
LAYOUT = re.compile(r"(?:tp(?P<tp>\d+))?(?:pp(?P<pp>\d+))?(?:ep(?P<ep>\d+))?(?:etp(?P<etp>\d+))?$")


def parse_job(job: str) -> tuple[str, dict[str, str], str]:
    """MODEL, the parallel sizes of LAYOUT (as written) as mconvert's flags name them, DTYPE."""
    model, layout, *rest = job.split(":")
    return model, layout_sizes(layout.partition(">")[0]), rest[0] if rest else "fp32"


def layout_sizes(layout: str) -> dict[str, str]:
    return {k: v for k, v in LAYOUT.match(layout).groupdict().items() if v}


def loaded_sizes(job: str) -> dict[str, str]:
    """The parallel sizes the job's checkpoint is verified at: LOADED of WRITTEN>LOADED, else as written."""
    written, _, loaded = job.split(":")[1].partition(">")
    return layout_sizes(loaded or written)


# Families whose hub names write_random_hf_checkpoint (transformers' in-memory names) does not give: a model built and
# saved by transformers' save_pretrained, which writes the hub's (Nemotron-H: `backbone.`, one tensor an expert).
SAVED_BY_TRANSFORMERS = {"nemotron_h"}


def write_hf_model(model: str, hf: Path, device: str, quantized: bool = False) -> float:
    """The random-init bf16 HF checkpoint of MODEL in `hf` unless there (`quantized`: as the hub stores it); the
    seconds it took."""
    if (hf / "config.json").exists():
        return 0.0
    config = model_config(model)
    config["torch_dtype"] = "bfloat16"
    started = time.perf_counter()
    if config.get("model_type") in SAVED_BY_TRANSFORMERS:
        make_hf_checkpoint(config, hf, dtype="bfloat16")
    else:
        write_random_hf_checkpoint(config, hf, device=device, quantized=quantized)
    return round(time.perf_counter() - started, 1)


def run(command: list[str]) -> tuple[int, float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    return done.returncode, time.perf_counter() - started, done.stdout + done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jobs", nargs="+")
    parser.add_argument("--work", type=Path, required=True, help="scratch space for the models and checkpoints")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--device", default="cuda", help="cpu to try the script on a small model")
    parser.add_argument("--spec", choices=("te", "local"), default=None, help="verify's --spec (default: verify's default)")
    parser.add_argument("--model-class", choices=("gpt", "hybrid"), default="gpt", help="hf-to-mcore's --model-class")
    parser.add_argument("--quantized", action="store_true", help="HF models stored quantized as the hub stores them")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    jobs = options.jobs
    for number, job in enumerate(jobs):
        if time.perf_counter() - started > options.deadline_s:
            print(f"skipped {job}: deadline", flush=True)
            continue
        model, sizes, dtype = parse_job(job)
        hf = options.work / model
        made = write_hf_model(model, hf, options.device, options.quantized)
        flags = [f"--{k}={v}" for k, v in sizes.items()]
        mcore = options.work / f"{model}-{'-'.join(f'{k}{v}' for k, v in sizes.items())}"
        code, convert_s, convert_out = run(
            [*MCONVERT, "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(mcore), "--overwrite", *flags,
             "--model-class", options.model_class, "--dtype", dtype]
        )
        result = {"job": job, "model_class": options.model_class, "make_hf_s": made, "convert_s": round(convert_s, 1), "convert_exit": code}
        if code == 0:
            report = options.work / "report.json"
            report.unlink(missing_ok=True)  # a failed verify writes none: the last job's must not stand in for it
            code, verify_s, verify_out = run(
                [*MCONVERT, "verify", "--hf", str(hf), "--mcore", str(mcore), "--device", options.device, "--dtype", dtype,
                 "--json", str(report), *(f"--{k}={v}" for k, v in loaded_sizes(job).items()),
                 *(["--spec", options.spec] if options.spec else [])]
            )
            result.update(verify_s=round(verify_s, 1), verify_exit=code, verify_output=verify_out[-3000:])
            if report.exists():
                result["report"] = json.loads(report.read_text())
        else:
            result["convert_output"] = convert_out[-3000:]
        print(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=1), flush=True)
        with open(options.out / "results.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        # Real shapes fill a disk fast: keep one HF model and no checkpoint between jobs.
        shutil.rmtree(mcore, ignore_errors=True)
        if number + 1 == len(jobs) or parse_job(jobs[number + 1])[0] != model:
            shutil.rmtree(hf, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
