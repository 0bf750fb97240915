"""Loading benchmark: megatron-core's `dist_checkpointing.load` of mconvert's torch_dist checkpoint against
one megatron-core saved itself (`dist_checkpointing.save` of the same model, loaded from ours), same model,
same TP, CPU gloo ranks (or GPUs with --device cuda). Reports per rank the load's wall time and the bytes
its process read (`rchar` of /proc/self/io: every byte read() returned, page cache or not), to show that
each rank reads only its own slices.

    python scripts/bench/bench_load.py --model qwen2.5-0.5b --work-dir /tmp/load-bench --tp 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def save_megatrons_own(ours: str, theirs: str) -> None:
    """In each rank: load our checkpoint into megatron-core's model and save it with dist_checkpointing."""
    import torch
    from megatron.core import dist_checkpointing

    from mconvert.mcore.checkpoint import iteration_dir, read_args
    from mconvert.verify.megatron_side import load_model

    args = read_args(iteration_dir(Path(ours)))
    (model,) = load_model(ours, args, args.params_dtype if hasattr(args, "params_dtype") else torch.bfloat16, transformer_impl="local")
    release = Path(theirs) / "release"
    release.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0}, str(release))
    (Path(theirs) / "latest_checkpointed_iteration.txt").write_text("release")


def timed_loads(checkpoints: list[str], repeats: int, device: str) -> list[dict]:
    """In each rank: build the model once per load and time dist_checkpointing.load of each checkpoint in
    turn (alternating, `repeats` times); every rank's (seconds, bytes read), gathered."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from mconvert.mcore.checkpoint import iteration_dir, read_args
    from mconvert.verify.megatron_model import build_gpt_model

    args = read_args(iteration_dir(Path(checkpoints[0])))
    rows = []
    for repeat in range(repeats):
        for checkpoint in checkpoints:
            model = build_gpt_model(
                args, torch.bfloat16, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage(),
                transformer_impl="local", perform_initialization=False,
            ).to(device)
            sharded = {"model": model.sharded_state_dict()}
            dist.barrier()
            before, started = read_bytes(), time.perf_counter()
            state = dist_checkpointing.load(sharded, str(iteration_dir(Path(checkpoint))))
            model.load_state_dict(state["model"], strict=False)
            seconds, nbytes = time.perf_counter() - started, read_bytes() - before
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (seconds, nbytes))
            rows.append({"checkpoint": checkpoint, "repeat": repeat, "ranks": gathered})
            del model, sharded, state
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help="a config of mconvert/configs, NAME@LAYERS for fewer layers")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="write the per-rank figures here")
    options = parser.parse_args()

    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    from bench_convert import make_source, remove

    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.verify.distributed import run_ranks

    options.work_dir.mkdir(parents=True, exist_ok=True)
    source = make_source(options.model, options.work_dir)
    ours, theirs = options.work_dir / f"{options.model}.tp{options.tp}.mconvert", options.work_dir / f"{options.model}.tp{options.tp}.megatron"
    for path in (ours, theirs):
        if path.exists():
            remove(path)
    convert_hf_to_mcore(source, ours, parallelism=Parallelism(tp=options.tp))
    run_ranks(save_megatrons_own, str(ours), str(theirs), tp=options.tp, device=options.device, timeout_s=3000)
    sizes = {str(p): sum(f.stat().st_size for f in (p / "release").glob("*.distcp")) for p in (ours, theirs)}
    rows = run_ranks(timed_loads, [str(ours), str(theirs)], options.repeats, options.device, tp=options.tp, device=options.device, timeout_s=3000)

    print(f"| checkpoint | data files | load s (median of {options.repeats}, slowest rank) | bytes read per rank (MiB) |")
    print("|---|---|---|---|")
    for checkpoint, label in ((str(ours), "mconvert"), (str(theirs), "megatron-core's own save")):
        mine = [row for row in rows if row["checkpoint"] == checkpoint]
        seconds = statistics.median(max(s for s, _ in row["ranks"]) for row in mine)
        per_rank = [round(statistics.median(row["ranks"][r][1] for row in mine) / 2**20) for r in range(len(mine[0]["ranks"]))]
        print(f"| {label} | {sizes[checkpoint] / 2**20:.0f} MiB | {seconds:.2f} | {', '.join(map(str, per_rank))} |")
    if options.json:
        options.json.write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
