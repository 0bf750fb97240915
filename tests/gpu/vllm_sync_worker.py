"""One rank of tests/gpu/test_engine_sync.py: a Megatron trainer rank and a vLLM engine rank in one process, as
colocated RL runs them (verl's and NeMo-RL's hybrid engines), on two GPUs under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/vllm_sync_worker.py JOB.json

vLLM serves the export at TP 2 in these processes (`distributed_executor_backend="external_launcher"`, as verl builds
it); megatron-core's parallel state is made on the process group vLLM made (TP 2 for a dense model, EP 2 for an MoE)
and its GPTModel loads the conversion. The three ways of tests/gpu/sync_ways.py (mconvert's `gather_hf_weights`, a
gather of everything to rank 0 then a send, 512 MB buckets) then hand the Megatron weights to the engine's
`model.load_weights`, each timed and measured (GPU memory allocated and host RSS, the peak beyond what was held
before), each after the engine's weights were perturbed and followed by greedy generation, which must give the
export's tokens again.

vLLM's multi-latent attention makes W_UK and W_UV from kv_b_proj when the model loads (views of it in bf16, copies
where it is quantized): after each `load_weights` its attention layers' `process_weights_after_loading` makes them
anew, as RL frameworks call it. Rank 0 writes the job's "out" JSON: the export's tokens, each way's synced tokens,
timings and memory per rank, and the fault's tokens (the mconvert way with one tensor scaled by 1.5).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from sync_ways import sync_ways
from vllm_worker import ENGINE, greedy, write

REPEATS = 3  # timed syncs of each way, after which generation checks what the engine holds


def host_peak_reset() -> int | None:
    """This process's resident bytes now, its peak (VmHWM) reset to them (clear_refs 5); None where the kernel
    does not allow the reset (the peak would be the process's whole life's)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return status_bytes("VmRSS")


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main(job: dict) -> None:
    import torch
    import torch.distributed as dist
    from vllm import LLM

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    result: dict = {"ranks": int(os.environ["WORLD_SIZE"])}
    started = time.time()
    llm = LLM(**dict(ENGINE, model=job["model"], tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                     dtype="bfloat16", gpu_memory_utilization=job.get("gpu_memory_utilization", 0.2)))
    result["engine_seconds"] = round(time.time() - started, 1)
    result["export"] = greedy(llm, job["prompts"], job["tokens"])

    def refresh(model: torch.nn.Module) -> None:
        """Multi-latent attention's W_UK and W_UV made again from kv_b_proj (no-op for other attention)."""
        for module in model.modules():
            if type(module).__name__ == "MLAAttention":
                module.process_weights_after_loading(torch.bfloat16)

    def perturb(model: torch.nn.Module) -> None:
        generator = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1 and parameter.dtype in (torch.float32, torch.bfloat16, torch.float16):
                    parameter.add_(torch.randn(parameter.shape, generator=generator, device=parameter.device).to(parameter.dtype) * 0.1)
        refresh(model)

    def load(weights) -> None:
        def into(model: torch.nn.Module) -> None:
            model.load_weights(weights)
            refresh(model)

        llm.apply_model(into)

    from megatron.core import parallel_state

    from mconvert.mcore.checkpoint import RELEASE, read_args
    from mconvert.verify.megatron_side import load_model

    assert dist.is_initialized() and dist.get_world_size() == 2, "vLLM's external launcher made no world of 2"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=job["tp"], expert_model_parallel_size=job["ep"])
    args = read_args(Path(job["mcore"]) / RELEASE)
    (model,) = load_model(job["mcore"], args, torch.bfloat16, device="cuda", transformer_impl="local")
    config = json.loads((Path(job["model"]) / "config.json").read_text())
    result["megatron_bytes_per_rank"] = sum(p.nbytes for p in model.parameters())

    ways = sync_ways(model, config, load, torch.device("cuda"))

    def measured(way) -> dict:
        torch.cuda.synchronize()
        dist.barrier()
        base_gpu = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        base_host = host_peak_reset()
        began = time.perf_counter()
        delivered = way()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        dist.barrier()
        return {"seconds": seconds, "bytes": delivered, "gpu_extra": torch.cuda.max_memory_allocated() - base_gpu,
                "host_extra": None if base_host is None else max(0, status_bytes("VmHWM") - base_host)}

    result["ways"] = {}
    for way_name, way in ways.items():
        llm.apply_model(perturb)
        perturbed = greedy(llm, job["prompts"], job["tokens"])
        runs = [measured(way) for _ in range(REPEATS)]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, runs)
        synced = greedy(llm, job["prompts"], job["tokens"])
        seconds = statistics.median(max(rank_runs[i]["seconds"] for rank_runs in everyone) for i in range(REPEATS))
        result["ways"][way_name] = {
            "perturbed": perturbed, "synced": synced, "seconds": seconds, "bytes": runs[0]["bytes"],
            "gb_per_s": runs[0]["bytes"] / 1e9 / seconds,
            "gpu_extra_mib": [max(r["gpu_extra"] for r in rank_runs) / 2**20 for rank_runs in everyone],
            "host_extra_mib": [None if None in (h := [r["host_extra"] for r in rank_runs]) else max(h) / 2**20 for rank_runs in everyone],
        }
    llm.apply_model(perturb)
    ways["gather_hf_weights"](job["fault_tensor"])
    result["synced_with_fault"] = greedy(llm, job["prompts"], job["tokens"])
    result["fault_tensor"] = job["fault_tensor"]
    result["seconds"] = round(time.time() - started, 1)
    if rank == 0:
        write(job["out"], result)


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        main(spec)
    except Exception:  # noqa: BLE001 (the test fails with it)
        if os.environ.get("RANK") == "0":
            write(spec["out"], {"error": traceback.format_exc()[-4000:]})
        traceback.print_exc()
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine threads and process groups are not waited for
