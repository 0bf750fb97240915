"""vLLM's side of tests/gpu/test_vllm.py, run in a process of its own with vLLM's packages on its path
(scripts/gpu/vllm_setup.sh installs them apart: their pins, pydantic's among them, stay out of the Megatron runs).

    python tests/gpu/vllm_worker.py serve JOBS.json      # each job: load a model directory in vLLM (and an adapter), greedy tokens
    python tests/gpu/vllm_worker.py sync JOB.json        # weight sync from a Megatron model into a live engine

A job's result is written to its "out" file as soon as it is done (a later job's failure leaves the earlier ones);
a job that fails writes {"error": ...} there and the next one starts. The prompts are token ids (no tokenizer: the
engine is built with skip_tokenizer_init), the sampling greedy, with each chosen token's logprob.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

# A small engine: the test models are tiny, the prompts short. Up to three engines share a GPU (tests/gpu/test_vllm.py):
# each KV cache is fixed at 1 GiB, which skips vLLM's memory profiling (another process's allocations would count as
# this one's), and each may take a fifth of the GPU.
ENGINE = dict(enforce_eager=True, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.2,
              kv_cache_memory_bytes=1 << 30, seed=0)
# An engine that has not served its job after this long is taken as hung (a job may name its own "limit_s").
JOB_LIMIT_S = 150


def engine(model: str, tp: int = 1, dtype: str = "bfloat16", attention_backend: str | None = None, **options):
    """An engine of ENGINE's size for `model`; `options` are the job's own engine arguments (tests/gpu/test_vllm.py)."""
    from vllm import LLM

    options = dict(ENGINE, model=model, tensor_parallel_size=tp, dtype=dtype, **options)
    if attention_backend:
        options["attention_backend"] = attention_backend
    return LLM(**options)


def greedy(llm, prompts: list[list[int]], tokens: int, lora: str | None = None, lora_3d: bool = False) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0, detokenize=False)
    request = None
    if lora is not None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("adapter", 1, lora, is_3d_lora_weight=lora_3d)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False, lora_request=request)
    result = {"tokens": [], "logprobs": []}
    for output in outputs:
        completion = output.outputs[0]
        result["tokens"].append(list(completion.token_ids))
        result["logprobs"].append([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
    return result


def write(path: str, result: dict) -> None:
    Path(path).write_text(json.dumps(result))
    print(f"vllm_worker: wrote {path}", flush=True)


def shut(llm) -> None:
    """The engine's processes and GPU memory given back before the next job's engine starts."""
    import gc

    import torch

    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def hung(signum, frame):
    raise TimeoutError("the job ran past its time limit")


def serve(jobs: list[dict]) -> None:
    signal.signal(signal.SIGALRM, hung)
    for job in jobs:
        started = time.time()
        print(f"vllm_worker: {job['name']}: {job['model']} at TP {job.get('tp', 1)}", flush=True)
        llm = None
        signal.alarm(job.get("limit_s", JOB_LIMIT_S))
        try:
            llm = engine(job["model"], job.get("tp", 1), job.get("dtype", "bfloat16"), job.get("attention_backend"), **job.get("engine", {}))
            result = greedy(llm, job["prompts"], job["tokens"], job.get("lora"), job.get("lora_3d", False))
        except Exception:  # noqa: BLE001 (the job's test fails with it; the next job goes on)
            result = {"error": traceback.format_exc()[-4000:]}
        finally:
            signal.alarm(0)
        result["seconds"] = round(time.time() - started, 1)
        write(job["out"], result)
        if llm is not None:
            try:
                shut(llm)
            except Exception:  # noqa: BLE001 (the next engine may still start)
                traceback.print_exc()


def sync(job: dict) -> None:
    """The export served; the engine's weights perturbed (so that a sync that does nothing fails); megatron-core's
    GPTModel loaded from the conversion in this process, its weights pushed through mconvert's gather_hf_weights into
    the engine's model.load_weights; generation again. Then the fault: the same sync with one tensor scaled."""
    import torch
    import torch.distributed as dist

    started = time.time()
    result: dict = {}
    try:
        llm = engine(job["model"], 1, job.get("dtype", "bfloat16"))
        result["export"] = greedy(llm, job["prompts"], job["tokens"])

        def perturb(model: torch.nn.Module) -> int:
            generator = torch.Generator(device="cuda").manual_seed(0)
            with torch.no_grad():
                for parameter in model.parameters():
                    if parameter.dim() > 1 and parameter.dtype in (torch.float32, torch.bfloat16, torch.float16):
                        parameter.add_(torch.randn(parameter.shape, generator=generator, device=parameter.device).to(parameter.dtype) * 0.1)
            return 0

        llm.apply_model(perturb)
        result["perturbed"] = greedy(llm, job["prompts"], job["tokens"])

        # megatron-core on the process group vLLM made (one rank), its parallel state on top.
        from megatron.core import parallel_state

        from mconvert.converters.rank_export import gather_hf_weights
        from mconvert.mcore.checkpoint import RELEASE, read_args
        from mconvert.verify.megatron_side import load_model

        assert dist.is_initialized(), "vLLM made no process group"
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        args = read_args(Path(job["mcore"]) / RELEASE)
        (model,) = load_model(job["mcore"], args, torch.float32, device="cuda", transformer_impl="local")
        config = json.loads((Path(job["model"]) / "config.json").read_text())

        def push(scaled: str | None) -> list[str]:
            names: list[str] = []

            def weights():
                for name, tensor in gather_hf_weights(model, config):
                    names.append(name)
                    yield name, (tensor * 1.5 if name == scaled else tensor)

            llm.apply_model(lambda served: served.load_weights(weights()))
            return names

        result["pushed"] = push(None)
        result["synced"] = greedy(llm, job["prompts"], job["tokens"])
        llm.apply_model(perturb)
        push(job["fault_tensor"])
        result["synced_with_fault"] = greedy(llm, job["prompts"], job["tokens"])
        result["fault_tensor"] = job["fault_tensor"]
    except Exception:  # noqa: BLE001 (the test fails with it)
        result["error"] = traceback.format_exc()[-4000:]
    result["seconds"] = round(time.time() - started, 1)
    write(job["out"], result)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(path).read_text())
    if mode == "serve":
        serve(spec)
    elif mode == "sync":
        sync(spec)
    else:
        raise SystemExit(f"vllm_worker: unknown mode {mode}")
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine threads and process groups are not waited for
