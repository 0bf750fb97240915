"""Weight sync from a Megatron model into a live vLLM 0.25.0 engine on two GPUs, with figures (issue 53, item 3):

    bash scripts/gpu/run_gpu_tests.sh -k engine_sync        # 2 GPUs, vLLM installed (scripts/gpu/vllm_setup.sh)

Two models wide enough that GB/s means something: a dense Qwen3 (hidden 1024, 8 layers, vocabulary 32768: 0.39 GB in
bf16) at Megatron TP 2, and an MoE DeepSeek-V3 (DeepSeek-V3's released attention dims, hidden 1024, 16 experts of 512,
3 layers: 0.30 GB) at Megatron EP 2; random weights at std 0.1 (mconvert.synthetic), hf-to-mcore at that layout and
mcore-to-hf back. tests/gpu/vllm_sync_worker.py runs, under torchrun, a Megatron rank and a vLLM engine rank (TP 2,
external launcher) in each process, as colocated RL does, and hands the weights to the engine's `load_weights` three
ways: mconvert's `gather_hf_weights`, every tensor gathered to rank 0 and then sent, and 512 MB buckets broadcast from
rank 0. After each, the engine's greedy tokens and logprobs must be the export's (the engine's weights were
perturbed first, which must change them); the fault: the mconvert way with one tensor scaled by 1.5 must not give
them. Recorded per way: seconds (median of 3, slowest rank), GB/s of whole HF tensors delivered to each engine rank,
and the peak memory beyond what each rank held before (GPU: torch.cuda.max_memory_allocated, the trainer's and the
engine's allocations together as they share the process; host: peak RSS). scripts/gpu/results_to_docs.py makes
docs/performance.md's table of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_cases import VLLM_MLA
from sync_ways import WAYS
from test_vllm import HERE, SYNCED, cli, compare, needs_vllm, worker_env, worker_log

# (mconvert's config, its fields, the Megatron layout's flags, a tensor for the fault).
MODELS = {
    "qwen3": ("qwen3-8b", dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                               num_key_value_heads=8, head_dim=128, vocab_size=32768),
              ("--tp", "2"), "model.layers.1.mlp.down_proj.weight"),
    "deepseek": ("deepseek-v3", dict(num_hidden_layers=3, first_k_dense_replace=1, hidden_size=1024, intermediate_size=2048,
                                     moe_intermediate_size=512, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                     topk_group=2, n_shared_experts=1, num_attention_heads=16, num_key_value_heads=16,
                                     q_lora_rank=512, vocab_size=32768, num_nextn_predict_layers=0, **VLLM_MLA),
                 ("--ep", "2"), "model.layers.1.mlp.shared_experts.down_proj.weight"),
}
CASES = [pytest.param(("qwen3", "tp2"), id="qwen3-tp2"), pytest.param(("deepseek", "ep2"), id="deepseek-ep2")]
# One torchrun's seconds: two engine starts, the Megatron load, ten syncs and eight generations.
RUN_LIMIT_S = 200

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2), needs_vllm]


def config_of(name: str) -> dict:
    from mconvert.synthetic import real_config

    source, fields, _, _ = MODELS[name]
    config = {key: value for key, value in real_config(source).items() if key != "quantization_config"}
    return {**config, **fields, "torch_dtype": "bfloat16"}


class SyncWork:
    """Each asked-for model made, converted and exported, then its torchrun, one after the other (the figures of one
    undisturbed by the other)."""

    def __init__(self, root: Path, names: list[str], deadline: float):
        import torch

        from mconvert.synthetic import make_hf_checkpoint

        self.root, self.errors = root, {}
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (12, 40, 70)]
        jobs = {}
        for name in names:
            _, _, layout, fault = MODELS[name]
            model = root / name
            try:
                make_hf_checkpoint(config_of(name), model / "hf", dtype="bfloat16", weight_std=0.1)
                log = model / "convert.log"
                cli("hf-to-mcore", "--load-dir", str(model / "hf"), "--save-dir", str(model / "mcore"), "--overwrite", *layout, log=log)
                cli("mcore-to-hf", "--load-dir", str(model / "mcore"), "--save-dir", str(model / "export"), "--hf-config", str(model / "hf"), log=log)
            except Exception as error:  # noqa: BLE001 (its case fails with it)
                self.errors[name] = str(error)
                continue
            jobs[name] = {"model": str(model / "export"), "mcore": str(model / "mcore"), "prompts": prompts, "tokens": 16,
                          "tp": 2 if layout[0] == "--tp" else 1, "ep": 2 if layout[0] == "--ep" else 1, "fault_tensor": fault,
                          "out": str(root / f"{name}.result.json")}
        for port, (name, job) in enumerate(jobs.items(), 29511):
            (root / f"{name}.json").write_text(json.dumps(job))
            with open(worker_log(root, f"sync_{name}"), "w") as out:
                run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                                        str(HERE / "vllm_sync_worker.py"), str(root / f"{name}.json")],
                                       stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parents[1], start_new_session=True,
                                       # The engine in each rank's process, as the external launcher needs (and verl sets).
                                       env={**worker_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
                try:
                    run.wait(timeout=max(1.0, min(deadline - time.time(), RUN_LIMIT_S)))
                except subprocess.TimeoutExpired:
                    os.killpg(run.pid, signal.SIGKILL)
                    run.wait()
                    out.write("\ntest_engine_sync: the run went past its limit and was stopped\n")

    def result(self, name: str) -> dict:
        if name in self.errors:
            pytest.fail(f"{name}'s model or conversion failed: {self.errors[name]}")
        path = self.root / f"{name}.result.json"
        if not path.exists():
            log = worker_log(self.root, f"sync_{name}")
            pytest.fail(f"the sync left no result for {name}; its log ends:\n{log.read_text()[-3000:] if log.exists() else '(none)'}")
        result = json.loads(path.read_text())
        if "error" in result:
            pytest.fail(f"the sync failed on {name}:\n{result['error']}")
        return result


@pytest.fixture(scope="session")
def sync_work(request, tmp_path_factory) -> SyncWork:
    names = [item.callspec.params["sync_case"][0] for item in request.session.items
             if "sync_case" in getattr(getattr(item, "callspec", None), "params", {}) and item.get_closest_marker("skip") is None]
    base = Path(os.environ["MCONVERT_GPU_WORK"]) if os.environ.get("MCONVERT_GPU_WORK") else tmp_path_factory.mktemp("sync")
    root = base / "engine_sync"
    root.mkdir(parents=True, exist_ok=True)
    return SyncWork(root, list(dict.fromkeys(names)), time.time() + float(os.environ.get("MCONVERT_GPU_DEADLINE_S", "1200")))


@pytest.mark.parametrize("sync_case", CASES)
def test_engine_sync_with_figures(sync_case, sync_work, record):
    name, layout = sync_case
    result = sync_work.result(name)
    export, failures = result["export"], []
    for way in WAYS:
        figures = result["ways"][way]
        _, perturbed = compare(export, figures["perturbed"])
        equal, synced = compare(export, figures["synced"])
        record("synced_max_logprob_difference", synced, SYNCED, equal and synced <= SYNCED and perturbed > SYNCED, way=way,
               tokens_equal=equal, perturbed_max_logprob_difference=perturbed)
        record("sync_gb_per_s", figures["gb_per_s"], None, True, way=way, seconds=figures["seconds"], gb=figures["bytes"] / 1e9,
               gpu_extra_mib=figures["gpu_extra_mib"], host_extra_mib=figures["host_extra_mib"],
               engine_seconds=result["engine_seconds"], megatron_gb_per_rank=result["megatron_bytes_per_rank"] / 1e9)
        if perturbed <= SYNCED:
            failures.append(f"{way}: perturbing the engine's weights changed nothing ({perturbed})")
        if not (equal and synced <= SYNCED):
            failures.append(f"{way}: the synced engine does not generate as the export ({equal}, {synced})")
    fault_equal, fault = compare(export, result["synced_with_fault"])
    record("fault_max_logprob_difference", fault, SYNCED, fault > SYNCED, fault=f"{result['fault_tensor']} scaled by 1.5",
           tokens_equal=fault_equal)
    assert not failures, failures
    assert fault > SYNCED, f"a sync with {result['fault_tensor']} scaled gives the export's logprobs"
