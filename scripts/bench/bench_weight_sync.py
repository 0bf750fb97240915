"""RL weight-sync benchmark: `gather_hf_weights` (mconvert/converters/rank_export.py: whole HF-named tensors
from a live TP/EP-sharded megatron-core model, piece by piece) against a plain all-gather of the same
parameters over the same process groups (what a trainer does without a converter: every rank gets every
shard, still Megatron-named and -shaped). Throughput in GB/s of whole tensors delivered to each rank, and
the peak memory beyond the model (CUDA's max_memory_allocated on GPUs; on CPU the process's peak RSS).

    # GPUs (NCCL), one host:
    python scripts/bench/bench_weight_sync.py --model qwen2.5-7b-instruct@8 --tp 2 --device cuda
    python scripts/bench/bench_weight_sync.py --model qwen3-30b-a3b@4 --ep 2 --device cuda
    # CPU check with a shrunk model (gloo):
    python scripts/bench/bench_weight_sync.py --model qwen3-30b-a3b --shrink --ep 2 --device cpu
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def peak_memory(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak(device: str) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return peak_memory(device)


def sync_ranks(config: dict, repeats: int, device: str) -> dict:
    """In each rank: build the model (random weights), then time, `repeats` times each and alternating, the
    two ways of handing its weights over."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mconvert.converters.rank_export import gather_hf_weights, local_shards
    from mconvert.mappings import get_mapping
    from mconvert.mcore.layout import EXPERTS_PREFIX
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.megatron_lm.args import megatron_args
    from mconvert.verify.megatron_model import build_gpt_model

    _, spec = get_mapping(config)
    layout = Parallelism(
        tp=parallel_state.get_tensor_model_parallel_world_size(), ep=parallel_state.get_expert_model_parallel_world_size()
    )
    args = megatron_args(spec, layout, torch.bfloat16, "local")
    model = build_gpt_model(args, torch.bfloat16, True, True, transformer_impl="local").to(device)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False) or tp_group

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def mconvert_way() -> int:
        delivered = 0
        for _, tensor in gather_hf_weights(model, config):
            delivered += tensor.nbytes  # the consumer (an inference engine) would copy it here, then drop it
        return delivered

    shards = list(local_shards(model).values())

    def all_gather_way() -> int:
        delivered = 0
        for info, data in shards:
            group = expert_group if EXPERTS_PREFIX in info.key else tp_group
            parts = [torch.empty_like(data) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, data.contiguous(), group=group)
            delivered += sum(part.nbytes for part in parts)
            del parts
        return delivered

    results: dict[str, list[tuple[float, int, int]]] = {"gather_hf_weights": [], "plain all_gather": []}
    for _ in range(repeats):
        for name, way in (("gather_hf_weights", mconvert_way), ("plain all_gather", all_gather_way)):
            synchronize()
            base = reset_peak(device)
            started = time.perf_counter()
            delivered = way()
            synchronize()
            results[name].append((time.perf_counter() - started, delivered, peak_memory(device) - base))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    return {"ranks": gathered, "model_bytes_per_rank": sum(d.nbytes for _, d in shards)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b-instruct@8", help="a config of mconvert/configs, NAME@LAYERS for fewer layers")
    parser.add_argument("--shrink", action="store_true", help="the test-size model of that config (CPU checks)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()

    from mconvert.synthetic import model_config, shrink
    from mconvert.verify.distributed import run_ranks

    config = model_config(options.model)
    if options.shrink:
        config = shrink(config, layers=config["num_hidden_layers"] if "@" in options.model else 2)
    result = run_ranks(sync_ranks, config, options.repeats, options.device, tp=options.tp, ep=options.ep, device=options.device, timeout_s=3000)

    print(f"{options.model}{' (shrunk)' if options.shrink else ''}, TP={options.tp} EP={options.ep}, {options.device}, "
          f"model shard per rank {result['model_bytes_per_rank'] / 2**30:.2f} GiB, medians of {options.repeats}")
    print("| way | s (slowest rank) | GB delivered per rank | GB/s per rank | peak extra memory (largest rank) |")
    print("|---|---|---|---|---|")
    for way in ("gather_hf_weights", "plain all_gather"):
        runs = [rank[way] for rank in result["ranks"]]
        seconds = statistics.median(max(rank[i][0] for rank in runs) for i in range(options.repeats))
        delivered = runs[0][0][1]
        extra = max(run[2] for rank in runs for run in rank)
        print(f"| {way} | {seconds:.3f} | {delivered / 1e9:.3f} | {delivered / 1e9 / seconds:.3f} | {extra / 2**20:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
