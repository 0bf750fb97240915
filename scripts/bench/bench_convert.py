"""Conversion benchmark: HF -> torch_dist of random-init models at full size, against `cp -r` of the same
HF directory on the same disk.

For each model, each page-cache condition and each repeat, it times `cp -r SRC` and then the conversion CLI
(`python -m mconvert.cli hf-to-mcore`), both as child processes run the same way, and reads the conversion's
peak resident memory from the kernel's accounting of that child (wait4's ru_maxrss). Times are taken at the
child's exit and again after a `sync` that follows it (the data on disk, not only in the page cache).

Page-cache conditions, applied before each timed command:
  cold  `sync; echo 3 > /proc/sys/vm/drop_caches`: source, Python and torch all come from disk (needs root)
  warm  the source directory is read once, so it is in the page cache (as right after a download)

It also times, the same way, the start of a Python process that imports the converter (torch among it):
a fixed cost of each conversion, which weighs on small models.

Targets: conversion / cp <= 1.3, and peak RSS < 1 GiB + 2 x the largest tensor.

    python scripts/bench/bench_convert.py --models qwen2.5-0.5b qwen2.5-7b-instruct --work-dir /work/bench-data
    python scripts/bench/bench_convert.py --models 'deepseek-v3@2+first_k_dense_replace=1' --quantized --ep 8 --work-dir ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
# Nothing that imports torch at module level: a timed child's peak RSS (ru_maxrss) starts from this process's
# at the fork.

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
GiB = 1 << 30
# Written last into a source directory: one without it is an interrupted generation, made again.
COMPLETE_MARK = ".complete"
IMPORT_CONVERTER = [sys.executable, "-c", "import mconvert.cli, mconvert.converters.hf_to_mcore"]


@dataclass
class Run:
    seconds: float  # until the command exits
    synced_seconds: float  # until the `sync` after it returns
    max_rss_bytes: int


def run_timed(command: list[str]) -> Run:
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    exited = time.perf_counter()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{process.stderr.read().decode()}")
    os.sync()
    return Run(exited - started, time.perf_counter() - started, usage.ru_maxrss * 1024)


def prepare_cache(condition: str, source: Path) -> None:
    os.sync()
    if condition == "cold":
        DROP_CACHES.write_text("3\n")
    else:
        for path in source.iterdir():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def remove(path: Path) -> None:
    shutil.rmtree(path)
    os.sync()  # freeing the blocks should not be charged to the next timed command


def make_source(model: str, work_dir: Path, quantized: bool = False) -> Path:
    """MODEL[@LAYERS][+FIELD=VALUE...] (mconvert.synthetic.model_config): the real config, cut to its first
    LAYERS layers when given (a MoE model's thousands of small expert tensors are measured well by a few layers);
    with `quantized`, in the hub's quantized layout where the config names one (DeepSeek-V3's FP8, gpt-oss's MXFP4)."""
    import torch

    from mconvert.full_size import write_random_hf_checkpoint
    from mconvert.synthetic import model_config

    source = work_dir / (model + ("-quantized" if quantized else ""))
    if not (source / COMPLETE_MARK).exists():
        if source.exists():
            shutil.rmtree(source)
        print(f"writing random {model} to {source} ...", flush=True)
        # The random numbers on a GPU where there is one: minutes on one core for a 15 GB model.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        write_random_hf_checkpoint(model_config(model), source, quantized=quantized, device=device)
        (source / COMPLETE_MARK).touch()
    return source


def human_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.0f} MiB"


def main() -> int:
    from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
    from mconvert.formats.quantized import fp8_block_size, is_mxfp4

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b"], help="configs from mconvert/configs as NAME[@LAYERS][+FIELD=VALUE...]")
    parser.add_argument("--work-dir", type=Path, required=True, help="where sources and outputs go (one disk)")
    parser.add_argument("--conditions", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--quantized", action="store_true", help="quantized sources where the config names a quantization (FP8, MXFP4)")
    options = parser.parse_args()
    if "cold" in options.conditions and not os.access(DROP_CACHES, os.W_OK):
        raise SystemExit(f"{DROP_CACHES} is not writable here: run as root or pass --conditions warm")
    options.work_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    for model in options.models:
        source = make_source(model, options.work_dir, options.quantized)
        config = read_hf_config(source, "--models")
        tensors = HFCheckpoint(source, fp8_block_size(config), mxfp4=is_mxfp4(config)).tensors
        largest = max(stored.end - stored.begin for stored in tensors.values())
        total = sum(stored.end - stored.begin for stored in tensors.values())
        rss_limit = GiB + 2 * largest
        copy_target, convert_target = options.work_dir / f"{model}.cp", options.work_dir / f"{model}.mcore"
        for path in (copy_target, convert_target):
            if path.exists():
                remove(path)
        convert = [
            sys.executable, "-m", "mconvert.cli", "hf-to-mcore",
            "--load-dir", str(source), "--save-dir", str(convert_target), "--tp", str(options.tp), "--ep", str(options.ep),
        ]
        # One copy first, not recorded: the first write of a model's size on a fresh machine can run slower than
        # the next (scripts/bench/bench_scaling.py).
        run_timed(["cp", "-r", str(source), str(copy_target)])
        remove(copy_target)
        for condition in options.conditions:
            copies, conversions, starts = [], [], []
            for _ in range(options.repeats):
                prepare_cache(condition, source)
                copies.append(run_timed(["cp", "-r", str(source), str(copy_target)]))
                remove(copy_target)
                prepare_cache(condition, source)
                conversions.append(run_timed(convert))
                remove(convert_target)
                prepare_cache(condition, source)
                starts.append(run_timed(IMPORT_CONVERTER))
            start = statistics.median(run.seconds for run in starts)
            copy = statistics.median(run.seconds for run in copies)
            copy_synced = statistics.median(run.synced_seconds for run in copies)
            seconds = statistics.median(run.seconds for run in conversions)
            synced = statistics.median(run.synced_seconds for run in conversions)
            rss = max(run.max_rss_bytes for run in conversions)
            rows.append(
                (
                    model, condition, f"{copy:.2f}", f"{seconds:.2f}", f"{seconds / copy:.2f}", f"{start:.2f}",
                    f"{copy_synced:.2f}", f"{synced:.2f}", f"{synced / copy_synced:.2f}",
                    f"{len(tensors) / seconds:.0f}", f"{total / seconds / GiB:.2f}",
                    human_bytes(rss), human_bytes(largest), human_bytes(rss_limit),
                    "yes" if seconds / copy <= 1.3 and rss < rss_limit else "no",
                )
            )
            print(f"{model} {condition}: cp {[round(r.seconds, 2) for r in copies]} s, "
                  f"convert {[round(r.seconds, 2) for r in conversions]} s, "
                  f"start {[round(r.seconds, 2) for r in starts]} s", flush=True)

    header = (
        "model", "cache", "cp s", "convert s", "ratio", "of which start s", "cp+sync s", "convert+sync s", "ratio+sync",
        "HF tensors/s", "GiB/s", "peak RSS", "largest tensor", "RSS target", "targets met",
    )
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nmedians of {options.repeats} runs; peak RSS is the largest of them; tp={options.tp} ep={options.ep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
