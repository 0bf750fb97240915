"""One peer converter's step, as its own code and documentation say to run it, in a process of its own (so that
gpu_peers.py times it whole, from start to exit). Each prints one JSON line of its stages' seconds.

    python scripts/gpu/peer_run.py mb-import HF OUT            # Megatron-Bridge 0.6.2: HF -> torch_dist
    python scripts/gpu/peer_run.py mb-export HF MCORE OUT      # Megatron-Bridge: its own torch_dist -> HF
    torchrun --nproc-per-node 1 scripts/gpu/peer_run.py mbridge HF MCORE OUT   # mbridge 0.15.1: HF -> model -> HF

Megatron-Bridge: AutoBridge.import_ckpt's own steps (from_hf_pretrained, to_megatron_provider, the model, its
save_megatron_model), with gradient_accumulation_fusion off: with Transformer Engine importable its provider turns
that on, which needs APEX (absent on the GPU machine), and import_ckpt has no setting for it. Its export_ckpt reads
only its own checkpoints (run_config.yaml). mbridge keeps the model in memory only: its torch_dist is megatron-core's
dist_checkpointing.save of the model's sharded state dict, and its export its save_weights.
"""

from __future__ import annotations

import json
import os
import sys
import time

started = time.perf_counter()
seconds: dict[str, float] = {}


def lap(stage: str) -> None:
    seconds[stage] = round(time.perf_counter() - started - sum(seconds.values()), 2)


def mb_import(hf: str, out: str) -> None:
    import torch
    from megatron.bridge import AutoBridge

    lap("import")
    bridge = AutoBridge.from_hf_pretrained(hf, torch_dtype=torch.bfloat16)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = provider.expert_model_parallel_size = 1
    provider.gradient_accumulation_fusion = False
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    lap("build_and_load")
    bridge.save_megatron_model(model, out, hf_tokenizer_path=hf, low_memory_save=True)
    lap("save")


def mb_export(hf: str, mcore: str, out: str) -> None:
    import torch
    from megatron.bridge import AutoBridge

    lap("import")
    AutoBridge.from_hf_pretrained(hf, torch_dtype=torch.bfloat16).export_ckpt(mcore, out, strict=True)
    lap("export")


def mbridge(hf: str, mcore: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from mbridge import AutoBridge
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    lap("import")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    bridge = AutoBridge.from_pretrained(hf)
    model = bridge.get_model(weight_path=hf)
    lap("build_and_load")
    release = os.path.join(mcore, "iter_0000001")
    os.makedirs(release, exist_ok=True)
    dist_checkpointing.save({"model": model[0].sharded_state_dict()}, release)
    with open(os.path.join(mcore, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("1")
    lap("save")
    bridge.save_weights(model, out)
    lap("export")
    dist.destroy_process_group()


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"mb-import": mb_import, "mb-export": mb_export, "mbridge": mbridge}[command](*paths)
    print(json.dumps({"peer_step": command, "seconds": seconds}), flush=True)
