"""The start of a small model's conversion: hf-to-mcore of a bf16 Qwen2.5-0.5B whole (0.94 GB), and mcore-to-hf of
what it wrote twice, first with an empty cache of transformers' class verdicts (converters/class_verdicts.py, in
WORK/cache) and then with the verdict the first kept, each as a whole process until it exits, against `cp -r` of
the same files (and the goal, 2 x `cp -r` of the checkpoint + 1 s), in rounds that alternate the trees given (an
older checkout of mconvert beside this one, to compare), page cache warm, each output removed and synced before the
next command.

    python scripts/bench/bench_start.py --work /tmp/start --rounds 5 [--tree old=/path/to/old/checkout] [--out OUT.jsonl]

Prints a JSON line per command, its wall and CPU (user + system) seconds (and appends it to --out), then each one's
ranges; `import` lines time `import torch` and this tree's conversion modules alone, as the start's parts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_convert import make_source  # noqa: E402


def timed(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[float, float]:
    """The command's wall time and its CPU time (user + system, with the children it waited for: the check's)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, command)
    return wall, usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR: another checkout of mconvert to time too")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    source = make_source(options.model, options.work)
    trees = {"this": REPO, **dict(entry.split("=", 1) for entry in options.tree)}
    out, back, cache = options.work / "out", options.work / "back", options.work / "cache"
    results: dict[str, list[tuple[float, float | None]]] = {}

    def record(name: str, times: tuple[float, float | None]) -> None:
        results.setdefault(name, []).append(times)
        line = json.dumps({"step": name, "seconds": round(times[0], 3), "cpu_seconds": None if times[1] is None else round(times[1], 3)})
        print(line, flush=True)
        if options.out is not None:
            with open(options.out, "a") as f:
                f.write(line + "\n")

    for _ in range(options.rounds):
        for name, tree in trees.items():
            for part, code in (("import torch", "import torch"),
                               ("import mconvert", "import mconvert.cli, mconvert.converters.hf_to_mcore, mconvert.converters.mcore_to_hf")):
                record(f"{name}: {part}", timed([sys.executable, "-c", code], cwd=Path(tree)))
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            subprocess.run(["cat", *map(str, source.glob("*.safetensors"))], check=True, stdout=subprocess.DEVNULL)
            record(f"{name}: hf-to-mcore", timed(
                [sys.executable, "-m", "mconvert", "hf-to-mcore", "--load-dir", str(source), "--save-dir", str(out), "--quiet"],
                cwd=Path(tree)))
            # First with an empty cache (the check builds transformers' class), then with the verdict it kept.
            shutil.rmtree(cache, ignore_errors=True)
            for run in ("first", "kept verdict"):
                shutil.rmtree(back, ignore_errors=True)
                os.sync()
                record(f"{name}: mcore-to-hf ({run})", timed(
                    [sys.executable, "-m", "mconvert", "mcore-to-hf", "--load-dir", str(out), "--save-dir", str(back), "--quiet"],
                    cwd=Path(tree), env={**os.environ, "MCONVERT_CACHE_DIR": str(cache)}))
        shutil.rmtree(back, ignore_errors=True)
        os.sync()
        copied = timed(["cp", "-r", str(out), str(back)])
        record("cp -r (the Megatron checkpoint)", copied)
        record("goal: 2 x cp -r (the Megatron checkpoint) + 1 s", (2 * copied[0] + 1, None))
        for made in (out, back):
            shutil.rmtree(made, ignore_errors=True)
        os.sync()
        record("cp -r", timed(["cp", "-r", str(source), str(out)]))
    for made in (out, back):
        shutil.rmtree(made, ignore_errors=True)
    for name, times in results.items():
        walls, cpus = [wall for wall, _ in times], [cpu for _, cpu in times if cpu is not None]
        cpu = f", CPU {min(cpus):.2f}-{max(cpus):.2f} s" if cpus else ""
        print(f"{name}: {min(walls):.2f}-{max(walls):.2f} s{cpu} over {len(times)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
