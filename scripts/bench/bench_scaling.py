"""Scaling benchmark: both directions with 1, 2, 4, 8 workers (threads of one process) and ranks (torchrun
processes, gloo), against `cp -r` and against a parallel copy of the same bytes by as many processes (the
fair limit for many workers), in one run on one disk; and the peers' approach (build megatron-core's model,
copy the weights in, `dist_checkpointing.save`) on a small model, in the same run.

Each command is a child process timed until it exits and until the `sync` after it (+sync); peak RSS is the
kernel's ru_maxrss of the child, which for torchrun is the largest of its rank processes (per process, not
summed). Page cache: "warm" (the source read once before each command), as bench_convert.py; outputs are
removed and synced between commands. Every row is appended to OUT/results.md (and OUT/results.jsonl) as it is
measured, so an interrupted run keeps what it measured.

    python scripts/bench/bench_scaling.py --work-dir /tmp/scale-bench --out /tmp/scale-bench/results \\
        --models qwen2.5-7b-instruct@14 qwen3-235b-a22b@2 --counts 1 2 4 8 --peers qwen2.5-0.5b

MODEL@LAYERS cuts a real config (mconvert/configs) to its first LAYERS layers. Sources are made once (random
init, hub layout) and kept in --work-dir; --keep-sources false removes each model's files when it is done.

--disk-for-two measures mcore-to-hf alone on a cut as large as a disk that holds two copies of it allows (so
that the fixed costs, the start and the last file's hash, weigh what they weigh on a whole model): the HF
source is removed once the torch_dist checkpoint is made from it, and `cp -r` and the parallel copies copy
that checkpoint, the same tensor bytes that mcore-to-hf reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

# No torch in this process: a timed child's peak RSS (ru_maxrss) starts from this process's at the fork.
from bench_convert import COMPLETE_MARK, GiB, human_bytes, remove, run_timed  # noqa: E402

PYTHON = sys.executable


def files_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def warm(directory: Path) -> None:
    """Read every file under `directory` once: in the page cache, as right after a download."""
    os.sync()
    for path in files_of(directory):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def copy_part(source: Path, target: Path, part: int, parts: int) -> None:
    """Copy byte range `part` of `parts` of every file of `source` into the same place under `target`
    (which `parallel_copy` laid out), with copy_file_range: in the kernel, as cp copies."""
    for path in files_of(source):
        size = path.stat().st_size
        begin, end = size * part // parts, size * (part + 1) // parts
        with open(path, "rb") as src, open(target / path.relative_to(source), "r+b") as dst:
            position = begin
            while position < end:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), end - position, position, position)
                if not copied:
                    break
                position += copied


def parallel_copy(source: Path, target: Path, parts: int) -> int:
    """Copy `source` to `target` with `parts` processes, each a byte range of every file."""
    for path in files_of(source):
        (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        with open(target / path.relative_to(source), "wb") as f:
            f.truncate(path.stat().st_size)
    me = str(Path(__file__).resolve())
    children = [subprocess.Popen([PYTHON, me, "--copy-part", str(i), str(parts), str(source), str(target)]) for i in range(parts)]
    return max(child.wait() for child in children)


def convert_command(direction: str, source: Path, target: Path, workers: int, ranks: int, extra: list[str]) -> list[str]:
    tail = [direction, "--load-dir", str(source), "--save-dir", str(target), "--workers", str(workers), *extra]
    if ranks == 1:
        return [PYTHON, "-m", "mconvert", *tail]
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "mconvert", *tail]


class Results:
    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.markdown, self.jsonl = out / "results.md", out / "results.jsonl"
        self.header = ("model", "step", "workers", "ranks", "s", "+sync s", "vs cp -r", "vs parallel copy", "GiB/s", "peak RSS/process")
        if not self.markdown.exists():
            self.markdown.write_text("| " + " | ".join(self.header) + " |\n|" + "---|" * len(self.header) + "\n")

    def add(self, row: dict) -> None:
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        cells = [
            row["model"], row["step"], str(row["workers"]), str(row["ranks"]), f"{row['seconds']:.2f}",
            f"{row['synced_seconds']:.2f}", row.get("vs_cp", ""), row.get("vs_parallel_copy", ""),
            f"{row['gib_per_s']:.2f}", human_bytes(row["max_rss_bytes"]),
        ]
        with open(self.markdown, "a") as f:
            f.write("| " + " | ".join(cells) + " |\n")
        print(" | ".join(cells), flush=True)


DEADLINE = [float("inf")]  # time.monotonic() after which measurements are skipped (--deadline-s)


def measure(results: Results, model: str, step: str, command: list[str], source: Path, target: Path, nbytes: int,
            workers: int, ranks: int, baselines: dict[str, float]) -> float:
    if time.monotonic() > DEADLINE[0]:
        print(f"skipped (past --deadline-s): {model} {step} workers={workers} ranks={ranks}", flush=True)
        return float("nan")
    warm(source)
    run = run_timed(command)
    if target.exists():
        remove(target)
    row = {
        "model": model, "step": step, "workers": workers, "ranks": ranks, "seconds": run.seconds,
        "synced_seconds": run.synced_seconds, "gib_per_s": nbytes / run.seconds / GiB, "max_rss_bytes": run.max_rss_bytes,
        "command": " ".join(command), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if "cp" in baselines:
        row["vs_cp"] = f"{run.seconds / baselines['cp']:.2f}"
    if workers * ranks in baselines:
        row["vs_parallel_copy"] = f"{run.seconds / baselines[workers * ranks]:.2f}"
    results.add(row)
    return run.seconds


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--copy":
        return parallel_copy(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
    if len(sys.argv) > 1 and sys.argv[1] == "--copy-part":
        part, parts, source, target = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5])
        copy_part(source, target, part, parts)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b-instruct@14", "qwen3-235b-a22b@2"])
    parser.add_argument("--work-dir", type=Path, required=True, help="sources and outputs (one disk)")
    parser.add_argument("--out", type=Path, required=True, help="results.md and results.jsonl, appended as measured")
    parser.add_argument("--counts", nargs="+", type=int, default=[1, 2, 4, 8], help="worker and rank counts")
    parser.add_argument("--modes", nargs="+", choices=("workers", "ranks"), default=["workers", "ranks"])
    parser.add_argument("--directions", nargs="+", choices=("hf-to-mcore", "mcore-to-hf"), default=["hf-to-mcore", "mcore-to-hf"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-shard-size", default=None, help="mcore-to-hf's --max-shard-size (more, smaller files: more hashed at once)")
    parser.add_argument("--peers", nargs="*", default=["qwen2.5-0.5b"], help="small models to measure the peers' approach on")
    parser.add_argument("--keep-sources", choices=("true", "false"), default="true")
    parser.add_argument("--deadline-s", type=float, default=None, help="skip the measurements not started within this many seconds")
    parser.add_argument("--disk-for-two", action="store_true", help="mcore-to-hf alone, with room for two copies of the model (module docstring)")
    options = parser.parse_args()
    if options.disk_for_two and (options.directions != ["mcore-to-hf"] or options.peers):
        parser.error("--disk-for-two measures mcore-to-hf alone: pass --directions mcore-to-hf and --peers with no models")
    if options.deadline_s is not None:
        DEADLINE[0] = time.monotonic() + options.deadline_s
    options.work_dir.mkdir(parents=True, exist_ok=True)
    results = Results(options.out)
    env_note = options.out / "machine.txt"
    env_note.write_text(subprocess.run("nproc; free -g; df -h " + str(options.work_dir) + "; lscpu | head -20", shell=True, capture_output=True, text=True).stdout)

    for model in [*options.peers, *options.models]:
        source = options.work_dir / model
        if not (source / COMPLETE_MARK).exists():  # made in a child, which imports torch and transformers
            subprocess.run([PYTHON, "-c", f"from pathlib import Path; from bench_convert import make_source; make_source({model!r}, Path({str(options.work_dir)!r}))"],
                           cwd=REPO / "scripts" / "bench", check=True)
        nbytes = sum(path.stat().st_size for path in source.glob("*.safetensors"))
        # The torch_dist checkpoint mcore-to-hf reads: made once, by 8 workers (for time: the tensors are those
        # one worker writes).
        mcore = options.work_dir / f"{model}.mcore"
        if mcore.exists():
            remove(mcore)
        extra = ["--tp", str(options.tp)]
        subprocess.run(convert_command("hf-to-mcore", source, mcore, 8, 1, extra), cwd=REPO, check=True, capture_output=True)
        copied, copy_step = source, "cp -r"
        if options.disk_for_two:
            remove(source)
            copied, copy_step = mcore, "cp -r of the torch_dist checkpoint"
        copy_target = options.work_dir / f"{model}.copy"
        # One copy first, not recorded: on a fresh KVM guest the first write of a model's size after the source
        # was made ran 1.4-3.2 times slower than the next (10.8 GB: 6.7-12.4 s against 3.1-5.1), where the
        # conversions measured after it write into the memory that each removed output freed.
        run_timed(["cp", "-r", str(copied), str(copy_target)])
        remove(copy_target)
        baselines: dict = {}
        baselines["cp"] = baselines[1] = measure(results, model, copy_step, ["cp", "-r", str(copied), str(copy_target)], copied, copy_target, nbytes, 1, 1, {})
        counts = options.counts if model not in options.peers else [1]
        for count in counts:
            if count > 1:
                baselines[count] = measure(results, model, f"parallel copy ({count} processes)", [PYTHON, str(Path(__file__).resolve()), "--copy", str(copied), str(copy_target), str(count)], copied, copy_target, nbytes, count, 1, {"cp": baselines["cp"]})
        if model in options.peers:
            peers_target = options.work_dir / f"{model}.peers"
            measure(results, model, "peers: model + dist_checkpointing.save", [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(REPO / "scripts" / "bench" / "peers_save.py"), str(source), str(peers_target)], source, peers_target, nbytes, 1, 1, baselines)
        for direction in options.directions:
            target = options.work_dir / f"{model}.{direction}"
            if direction == "hf-to-mcore":
                step, step_source, step_extra = direction, source, extra
            elif options.max_shard_size:
                step, step_source, step_extra = f"{direction} (--max-shard-size {options.max_shard_size})", mcore, ["--max-shard-size", options.max_shard_size]
            else:
                step, step_source, step_extra = direction, mcore, []
            for mode in options.modes:
                for count in counts:
                    if mode == "ranks" and count == 1:
                        continue  # the same as one worker
                    workers, ranks = (count, 1) if mode == "workers" else (1, count)
                    measure(results, model, step, convert_command(direction, step_source, target, workers, ranks, step_extra),
                            step_source, target, nbytes, workers, ranks, baselines)
        remove(mcore)
        if options.keep_sources == "false" and source.exists():
            remove(source)
    print(f"\nresults in {results.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
