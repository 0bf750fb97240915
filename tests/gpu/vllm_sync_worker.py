"""One rank of tests/gpu/test_engine_sync.py: a Megatron trainer rank and a vLLM engine rank in one process, as
colocated RL runs them (verl's and NeMo-RL's hybrid engines), on two GPUs under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/vllm_sync_worker.py JOB.json

vLLM serves the export at TP 2 in these processes (`distributed_executor_backend="external_launcher"`, as verl builds
it); megatron-core's parallel state is made on the process group vLLM made (TP 2 for a dense model, EP 2 for an MoE)
and its GPTModel loads the conversion. Three ways then hand the Megatron weights to the engine's `model.load_weights`,
each timed and measured (GPU memory allocated and host RSS, the peak beyond what was held before), each after the
engine's weights were perturbed and followed by greedy generation, which must give the export's tokens again:

- `gather_hf_weights`: mconvert's API, every rank gathering each whole HF tensor from its TP or EP group piece by piece
  and handing it straight to its engine rank;
- `rank 0 gathers all`: every tensor gathered whole, the whole model held on rank 0's host, then sent tensor by
  tensor from rank 0 to every engine rank (NCCL broadcast), as a trainer that gathers a full state dict first does;
- `512 MB buckets`: the gathered tensors packed on rank 0 into 512 MB buffers, each broadcast to every engine rank
  and unpacked there into one `load_weights` call (the bucketed transfer of verl and NeMo-RL).

vLLM's multi-latent attention keeps W_UK and W_UV made from kv_b_proj when the model loads: after a `load_weights`,
its attention layers' `process_weights_after_loading` makes them anew, as RL frameworks call it. Rank 0 writes the
job's "out" JSON: the export's tokens, each way's synced tokens, timings and memory per rank, and the fault's tokens
(the mconvert way with one tensor scaled by 1.5).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from vllm_worker import ENGINE, greedy, write

BUCKET_BYTES = 512 << 20
ALIGN = 256  # each tensor's offset in a bucket, in bytes: a view of any dtype starts aligned
REPEATS = 3  # timed syncs of each way; the first is also checked by generation


def host_peak_reset() -> int:
    """This process's resident bytes now, its peak (VmHWM) reset to them where the kernel allows (clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
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

    from mconvert.converters.rank_export import gather_hf_weights
    from mconvert.mcore.checkpoint import RELEASE, read_args
    from mconvert.verify.megatron_side import load_model

    assert dist.is_initialized() and dist.get_world_size() == 2, "vLLM's external launcher made no world of 2"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=job["tp"], expert_model_parallel_size=job["ep"])
    args = read_args(Path(job["mcore"]) / RELEASE)
    (model,) = load_model(job["mcore"], args, torch.bfloat16, device="cuda", transformer_impl="local")
    config = json.loads((Path(job["model"]) / "config.json").read_text())
    result["megatron_bytes_per_rank"] = sum(p.nbytes for p in model.parameters())

    def mconvert_way(scaled: str | None = None) -> int:
        delivered = 0

        def weights():
            nonlocal delivered
            for name, tensor in gather_hf_weights(model, config):
                delivered += tensor.nbytes
                yield name, (tensor * 1.5 if name == scaled else tensor)

        load(weights())
        return delivered

    def rank0_way() -> int:
        held, meta = {}, []
        for name, tensor in gather_hf_weights(model, config):
            meta.append((name, tensor.shape, tensor.dtype))
            if rank == 0:
                held[name] = tensor.cpu()

        def weights():
            for name, shape, dtype in meta:
                tensor = held.pop(name).cuda() if rank == 0 else torch.empty(shape, dtype=dtype, device="cuda")
                dist.broadcast(tensor, src=0)
                yield name, tensor

        load(weights())
        return sum(shape.numel() * dtype.itemsize for _, shape, dtype in meta)

    def bucketed_way() -> int:
        bucket = torch.empty(BUCKET_BYTES, dtype=torch.uint8, device="cuda")
        pending: list[tuple[str, torch.Size, torch.dtype, int]] = []
        used = delivered = 0

        def send() -> None:
            dist.broadcast(bucket[:used], src=0)
            load((name, bucket[at:at + shape.numel() * dtype.itemsize].view(dtype).view(shape)) for name, shape, dtype, at in pending)

        for name, tensor in gather_hf_weights(model, config):
            size = tensor.nbytes
            assert size <= BUCKET_BYTES, f"{name}: {size} bytes, more than a bucket"
            if used + size > BUCKET_BYTES:
                send()
                pending, used = [], 0
            if rank == 0:
                bucket[used:used + size].copy_(tensor.contiguous().view(-1).view(torch.uint8))
            pending.append((name, tensor.shape, tensor.dtype, used))
            used += -(-size // ALIGN) * ALIGN
            delivered += size
        if pending:
            send()
        return delivered

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
                "host_extra": max(0, status_bytes("VmHWM") - base_host)}

    result["ways"] = {}
    for way_name, way in (("gather_hf_weights", mconvert_way), ("rank 0 gathers all", rank0_way), ("512 MB buckets", bucketed_way)):
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
            "host_extra_mib": [max(r["host_extra"] for r in rank_runs) / 2**20 for rank_runs in everyone],
        }
    llm.apply_model(perturb)
    mconvert_way(job["fault_tensor"])
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
