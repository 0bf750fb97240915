"""One torchrun of the GPU evidence: in each rank, for each job of a jobs file, in order:

- `megatron_lm`: Megatron-LM parses the checkpoint's MODEL_ARGS and LOAD_ARGS, builds the model as its
  pretrain_gpt.py (pretrain_hybrid.py) does and loads the checkpoint with its own `load_checkpoint`, strict
  (mconvert.verify.megatron_lm.load_as_megatron_lm); rank 0 saves the logits of the token file's prompts;
- `verify`: `mconvert verify` at the layout, its command line's own entry (mconvert.cli.main) run in this
  torchrun's ranks, as `torchrun ... -m mconvert.cli verify` runs it; rank 0 saves its exit code and JSON report.

    torchrun --standalone --nproc-per-node 4 tests/gpu/megatron_lm_worker.py JOBS.json OUT_DIR

Jobs of one layout share megatron-core's parallel state; between layouts it is made anew. A job that raises in any
rank leaves OUT_DIR/NAME.error and ends this rank (torchrun then stops the others): tests/gpu/gpu_evidence.py starts
the jobs left in a new torchrun. A job is done when OUT_DIR/NAME.done exists; jobs done are skipped, and none is
started past the jobs file's deadline (seconds since the epoch).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "scripts" / "gpu")]

import torch  # noqa: E402

from mconvert.verify.megatron_lm import CPU_FLAGS, RUN_FLAGS, script_arrays  # noqa: E402

# Collectives give up after this long: a rank stuck in one fails its job instead of holding the others.
COLLECTIVE_TIMEOUT_S = 180


def megatron_lm_argv(job: dict) -> list[str]:
    """The checkpoint's MODEL_ARGS and LOAD_ARGS as a user passes them, a training command line's schedule
    (RUN_FLAGS), the family's flags, and what this machine lacks said as flags."""
    flags = script_arrays(Path(job["ckpt"]), "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + job["megatron_flags"]
    if job["device"] == "cpu":
        return flags + CPU_FLAGS
    from gpu_train import for_this_machine

    return for_this_machine(flags, have_te=importlib.util.find_spec("transformer_engine") is not None)


def megatron_lm_logits(argv: list[str], tokens: torch.Tensor) -> torch.Tensor:
    """In every rank: Megatron-LM builds and loads; the logits are valid on rank 0."""
    from megatron.training import global_vars

    from mconvert.verify.megatron_lm import load_as_megatron_lm
    from mconvert.verify.megatron_side import forward_logits

    try:
        model, _ = load_as_megatron_lm(argv)
        return forward_logits(model, tokens)
    finally:
        # What Megatron-LM sets once a run, made anew for the next job: its globals (args, tokenizer, microbatch
        # calculator), and torch's deterministic algorithms, which --deterministic-mode turns on process-wide.
        global_vars.unset_global_variables()
        torch.use_deterministic_algorithms(False)


def run_in_layout(job: dict, fn, *args):
    """fn(*args) in this rank with megatron-core's parallel state at the job's layout, made anew when it differs."""
    from megatron.core import parallel_state

    from mconvert.verify.distributed import run_ranks

    layout = job["layout"]
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_tensor_parallel_world_size(),
        )
        wanted = (layout["tp"], layout["pp"], layout["ep"], layout["etp"] or layout["tp"])
        if current != wanted:
            parallel_state.destroy_model_parallel()
    return run_ranks(fn, *args, tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], etp=layout["etp"],
                     device=job["device"], timeout_s=COLLECTIVE_TIMEOUT_S)


def verify(job: dict, report: Path | None) -> int:
    """`mconvert verify` at the job's layout, the command line's own entry, in this torchrun's ranks; its JSON report
    to `report` (rank 0's alone: every rank would write it)."""
    from mconvert import cli

    spec = "local" if job["device"] == "cpu" else job["spec"]
    return cli.main(["verify", "--hf", job["hf"], "--mcore", job["ckpt"], *job["layout_flags"], "--device", job["device"],
                     "--spec", spec, *(["--json", str(report)] if report else []), "--timeout", str(COLLECTIVE_TIMEOUT_S)])


def run_job(job: dict, out: Path, tokens: torch.Tensor, rank: int) -> None:
    name = job["name"]
    if job["part"] == "megatron_lm":
        logits = run_in_layout(job, megatron_lm_logits, megatron_lm_argv(job), tokens)
        if rank == 0:
            torch.save(logits, out / f"{name}.pt")
    else:
        # verify's report and errors, as it prints them, rank 0's in the job's log (the others' in the torchrun's).
        with open(out / f"{name}.log", "w") if rank == 0 else contextlib.nullcontext(sys.stdout) as log:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                code = run_in_layout(job, verify, job, out / f"{name}.json" if rank == 0 else None)
        if rank == 0:
            (out / f"{name}.exit").write_text(str(code))


def past_deadline(deadline: float) -> bool:
    """Whether the deadline has passed, as all ranks decide it together (each clock read alone could split them)."""
    past = time.time() > deadline
    if not torch.distributed.is_initialized():
        return past  # before the first job: the torchrun was started before the deadline
    flag = torch.tensor([float(past)], device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def main() -> int:
    jobs_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    plan = json.loads(jobs_file.read_text())
    tokens = torch.load(plan["tokens"])
    rank = int(os.environ["RANK"])
    # Each job starts from this environment: megatron-core's models set the attention backend's variables (NVTE_*_ATTN)
    # and assert them at the next model, --deterministic-mode sets its own.
    environment = dict(os.environ)
    for job in plan["jobs"]:
        name = job["name"]
        if (out / f"{name}.done").exists() or (out / f"{name}.error").exists():
            continue
        if past_deadline(plan["deadline"]):
            break
        if rank == 0:
            (out / f"{name}.started").write_text(str(time.time()))
        started = time.perf_counter()
        try:
            # What verify and Megatron-LM print, every rank's, goes to the torchrun's log with the job named.
            print(f"[rank {rank}] {name}: start", flush=True)
            run_job(job, out, tokens, rank)
        except BaseException:  # noqa: BLE001 (any failure of the job: said in its file, then this rank ends)
            with open(out / f"{name}.error", "a") as error:
                error.write(f"rank {rank}:\n{traceback.format_exc()}\n")
            sys.stdout.flush()
            os._exit(1)
        finally:
            os.environ.clear()
            os.environ.update(environment)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        torch.distributed.barrier()
        if rank == 0:
            (out / f"{name}.done").write_text(f"{time.perf_counter() - started:.1f}")
        print(f"[rank {rank}] {name}: done in {time.perf_counter() - started:.1f} s", flush=True)
    with contextlib.suppress(Exception):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
