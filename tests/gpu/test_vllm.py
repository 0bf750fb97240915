"""vLLM 0.25.0 as the real client of mconvert's exports, on a GPU (issues 53 and 55):

- every export serves: a family's model (gpu_cases: a real config shrunk, random weights at std 0.1, the output
  layer at 0.5 so that greedy choices are clear) through `hf-to-mcore` and `mcore-to-hf`; vLLM loads the export and
  generates greedily; transformers in fp32 on the same GPU, fed the prompt and vLLM's tokens, must rank each of vLLM's
  tokens first (within GAP of its best) and give it vLLM's logprob (within LOGPROB; both within the family's own limit
  where gpu_cases declares one: an MoE's routing in bf16). DeepSeek-V3 at its released attention dims (gpu_cases.VLLM_MLA:
  vLLM's MLA takes no other latent head). Fault injection: the same comparison against transformers' model with
  layer 0's MLP weights negated must fail.
- quantized exports serve: an FP8 block release (128 x 128 blocks, as DeepSeek-V3's and Qwen3-FP8's) and a
  compressed-tensors pack-quantized INT4 release (groups of 32, as Kimi-K2-Thinking's) of a shrunk Qwen3, and an MXFP4
  release of a shrunk gpt-oss (its experts, as gpt-oss's; vLLM runs them with the triton_kernels its wheel vendors, or
  Marlin), through `hf-to-mcore` and `mcore-to-hf --hf-config RELEASE --quantize as-source`; vLLM serves the export and
  the release, and their greedy tokens must be equal. Fault injection: the export with one quantized tensor's scales
  doubled must not.
- weight sync into a live engine: vLLM serves the export; its weights are perturbed (generation changes); megatron-core's
  GPTModel, loaded from the conversion in the same process, pushes its weights through mconvert's `gather_hf_weights`
  into the engine's `model.load_weights`; the greedy tokens and logprobs must be the export's again. Fault injection:
  the same sync with one tensor scaled by 1.5 must not give them.

vLLM runs in tests/gpu/vllm_worker.py, a process with vLLM's packages on its path ($VLLM_SITE, default /tmp/site-vllm:
scripts/gpu/vllm_setup.sh); every test skips where they are not installed. bf16 (vLLM's FlashAttention takes no fp32);
transformers' reference in fp32 with TF32 off.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_cases import FAMILIES, FAMILY

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM_SITE = Path(os.environ.get("VLLM_SITE", "/tmp/site-vllm"))
# Families vLLM 0.25.0 serves, the risky ones last (multi-latent attention picks its own backend, first run at the
# released dims; the delta-net and Mamba layers run vLLM's own Triton kernels): a job that hangs takes only the time of
# those after it in its engine's queue.
SERVED = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "mixtral", "qwen2_moe", "glm4_moe", "olmoe", "olmo2",
          "ernie4_5", "dots1", "minimax_m2", "hy_v3", "gemma3_text", "gemma3", "qwen3_vl", "qwen3_5", "qwen3_next", "nemotron_h",
          "nemotron_h_latent", "deepseek", "glm4_moe_lite", "kimi_k25")
# Families mconvert converts that vLLM 0.25.0 does not serve, and why (its model registry and code, read in its wheel).
NOT_SERVED = {
    "deepseek_v32": "its sparse attention indexer runs on CUDA with DeepGEMM only (sparse_attn_indexer.py), which compiles "
                    "with nvcc at run time and is not carried",
    "qwen3_5_text": "no causal-LM class for Qwen3.5-MoE's text model (only Qwen3_5MoeForConditionalGeneration)",
    "olmo3": "its Olmo3 reads one rope (rope_parameters['rope_theta'], olmo2.py), while the GPU machines' transformers "
             "5.17 holds OLMo 3's rope per layer type (a KeyError); a config holding both fails transformers' own "
             "validation (H200, 2026-11-27)",
}
TP2 = ("llama", "qwen3_moe")
# Megatron-Bridge's adapter saves (tests/fixtures/megatron_bridge_lora) whose `adapter-to-hf` export vLLM serves as a
# LoRA request on the HF base: LoRA on fused q/k/v and gate/up, CanonicalLoRA, and every expert's adapters (PEFT's
# target_parameters of transformers' fused experts).
ADAPTER_SAVES = REPO / "tests" / "fixtures" / "megatron_bridge_lora"
ADAPTERS = ("tp2", "canonical-tp1", "moe-lora")
ADAPTER_VOCABULARY = 256  # the fixtures' bases': the adapter prompts are the prompts' tokens modulo it
LORA_RANK = 16  # the largest adapter rank the engine takes (vLLM's choices: 1, 8, 16, 32, ...)
# Engines started side by side for the served jobs, and conversions run side by side before them.
SERVE_WORKERS, CONVERSIONS = 4, 8
# An engine that compiles its Triton kernels: Nemotron-H's warm-up of vLLM's Mamba-2 kernels alone took 84 s, and its
# first tokens compiled more, past the 150 s of vllm_worker.JOB_LIMIT_S (4 x H200, 2026-11-27).
COMPILING_JOB_LIMIT_S = 330
PROMPT_LENGTHS, NEW_TOKENS = (12, 40, 70), 16  # past gpt-oss's shrunk window of 32
# bf16 in vLLM against fp32 in transformers, logits of about +-10: a token vLLM chose may trail transformers' best by at
# most GAP (a near tie flipped by rounding), and its logprob differ by at most LOGPROB.
GAP, LOGPROB = 0.25, 0.25
OUTPUT_STD = 0.5
QUANTIZED = ("fp8_block", "int4", "mxfp4")
# The vLLM processes' time, all together (each engine's own limit: vllm_worker.JOB_LIMIT_S).
WORKER_LIMIT_S = 450


def base_of(save: str) -> str:
    """The fixture folder of an adapter save's HF base: the MoE saves' own, else the dense one."""
    return f"{save}/hf" if save.startswith("moe") else "hf"


def vllm_installed() -> bool:
    return (VLLM_SITE / "vllm" / "__init__.py").exists()


def cases() -> list:
    """Every family at TP 1 (skipped with the reason where vLLM 0.25.0 does not serve it), the TP2 ones at TP 2."""
    unplaced = {family.name for family in FAMILIES} - set(SERVED) - set(NOT_SERVED)
    assert not unplaced, f"families neither SERVED nor NOT_SERVED: {sorted(unplaced)}"
    out = [pytest.param((family, "tp1"), id=f"{family}-tp1") for family in SERVED]
    out += [pytest.param((family, "tp1"), id=f"{family}-tp1", marks=pytest.mark.skip(reason=f"vLLM 0.25.0: {why}"))
            for family, why in NOT_SERVED.items()]
    out += [pytest.param((family, "tp2"), id=f"{family}-tp2", marks=pytest.mark.gpus(2)) for family in TP2]
    return out


needs_vllm = pytest.mark.skipif(not vllm_installed(), reason=f"vLLM is not installed in {VLLM_SITE} (scripts/gpu/vllm_setup.sh)")
pytestmark = [pytest.mark.gpu, needs_vllm]


def worker_log(work: Path, name: str) -> Path:
    """Where a worker's output goes as it runs: MCONVERT_VLLM_LOGS (scripts/gpu/run_gpu_tests.sh's $OUT) or the work folder."""
    return Path(os.environ.get("MCONVERT_VLLM_LOGS") or work) / f"vllm_{name}.log"


def worker_env() -> dict[str, str]:
    """The environment of a process that runs vLLM: its packages on the path, nothing asked of the network."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(VLLM_SITE), str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "TOKENIZERS_PARALLELISM": "false",
           # No network on the GPU machines: nothing asks the hub or sends usage statistics (and waits on it).
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           # FlashInfer is not carried: vLLM's sampler imports it unless told not to use its top-k/top-p kernels (the
           # engine failed to start without this, 2 x H200).
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def start_worker(mode: str, spec, work: Path, name: str, gpus: str | None = None) -> subprocess.Popen:
    """tests/gpu/vllm_worker.py on `spec`, in the background, its output in worker_log."""
    (work / f"{name}.json").write_text(json.dumps(spec))
    env = worker_env()
    if mode == "sync":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its model is reachable
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    with open(worker_log(work, name), "w") as log:
        return subprocess.Popen([sys.executable, str(HERE / "vllm_worker.py"), mode, str(work / f"{name}.json")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def wait(workers: dict[str, subprocess.Popen], work: Path, deadline: float) -> None:
    """Each worker to its end, or stopped (its process group) at the deadline; its log says which."""
    for name, worker in workers.items():
        try:
            worker.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            with open(worker_log(work, name), "a") as log:
                log.write("\ntest_vllm: the worker ran past the session's deadline and was stopped\n")


def cli(*args: str, log: Path) -> None:
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-m", "mconvert.cli", *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)})
    if done.returncode:
        raise RuntimeError(f"mconvert {args[0]} exit {done.returncode}:\n{log.read_text()[-3000:]}")


class Work:
    """The session's models, conversions and vLLM runs, made at the first test that asks and then read case by case."""

    def __init__(self, root: Path, families: list[str], tp2: list[str], quantized: list[str], adapters: list[str], sync: bool,
                 deadline: float):
        import torch

        from mconvert.synthetic import real_config

        self.root, self.deadline = root, deadline
        self.errors: dict[str, str] = {}
        generator = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
        self.adapter_prompts = [[token % ADAPTER_VOCABULARY for token in prompt] for prompt in self.prompts]
        # The vLLM processes side by side on the GPU (each engine's KV cache fixed in size: no memory profiling that
        # another process's allocations would upset).
        workers: dict[str, subprocess.Popen] = {}
        gpus = torch.cuda.device_count()
        families = sorted(families, key=lambda name: name != "qwen3")  # Qwen3 first: the sync starts on it
        self.made(families)
        jobs = []
        # The families whose engines compile Triton kernels (delta-net, Mamba: minutes each) first, one an engine.
        for family in sorted(families, key=lambda name: not FAMILY[name].compiles_kernels):
            if family in self.errors:
                continue
            case = FAMILY[family]
            config = real_config(case.config)
            text, engine = config.get("text_config", config), {}
            if "vision_config" in config:  # served on text: no image processor is read (the test models have none)
                engine["language_model_only"] = True
            if "linear_key_head_dim" in text:  # on Hopper vLLM takes FlashInfer's delta-net prefill, not carried
                engine["additional_config"] = {"gdn_prefill_backend": "triton"}
            # Multi-latent attention and image-text models: the backend vLLM picks (Gemma 3's image prefix needs one
            # other than FlashAttention 3).
            backend = None if "kv_lora_rank" in case.vllm_overrides or "vision_config" in config else "FLASH_ATTN"
            options = {"attention_backend": backend, "engine": engine}
            if case.compiles_kernels:
                options["limit_s"] = COMPILING_JOB_LIMIT_S
            jobs.append(self.job(f"{family}-tp1", self.export(family), **options))
            if family in tp2:
                jobs.append(self.job(f"{family}-tp2", self.export(family), tp=2, **options))
            if family == "qwen3" and sync:
                spec = self.job("sync", self.export("qwen3"))
                spec.update(mcore=str(root / "qwen3" / "mcore"), fault_tensor="model.layers.1.mlp.down_proj.weight")
                workers["sync"] = start_worker("sync", spec, root, "sync", gpus=str(gpus - 1) if gpus > 1 else None)
        for save in adapters:
            try:
                adapter = self.adapter(save)
            except Exception as error:  # noqa: BLE001 (its case fails with it)
                self.errors[save] = str(error)
                continue
            # Adapters of fused 3-D experts (PEFT's target_parameters): vLLM reads them into its per-expert layout when
            # the engine takes both formats and the request says so.
            experts = "target_parameters" in json.loads((adapter / "adapter_config.json").read_text())
            engine = {"enable_lora": True, "max_loras": 1, "max_lora_rank": LORA_RANK, "enable_mixed_moe_lora_format": experts}
            jobs.append({**self.job(f"adapter-{save}", ADAPTER_SAVES / base_of(save), attention_backend="FLASH_ATTN", engine=engine),
                         "prompts": self.adapter_prompts, "lora": str(adapter), "lora_3d": experts})
        # The jobs dealt out to SERVE_WORKERS engines side by side: each engine's start is mostly the host's work.
        for index in range(SERVE_WORKERS):
            if jobs[index::SERVE_WORKERS]:
                workers[f"serve{index}"] = start_worker("serve", jobs[index::SERVE_WORKERS], root, f"serve{index}")
        quantized_jobs = []
        for kind in quantized:
            try:
                self.quantized(kind)
            except Exception as error:  # noqa: BLE001
                self.errors[kind] = str(error)
                continue
            quantized_jobs += [self.job(f"{kind}-{which}", root / kind / which, attention_backend="FLASH_ATTN") for which in ("release", "export", "fault")]
        if quantized_jobs:
            workers["serve_quantized"] = start_worker("serve", quantized_jobs, root, "serve_quantized")
        wait(workers, root, min(self.deadline, time.time() + WORKER_LIMIT_S))

    def export(self, family: str) -> Path:
        return self.root / family / "export"

    def job(self, name: str, model: Path, tp: int = 1, attention_backend: str | None = None, **options) -> dict:
        return {"name": name, "model": str(model), "tp": tp, "prompts": self.prompts, "tokens": NEW_TOKENS,
                "attention_backend": attention_backend, "out": str(self.root / f"{name}.result.json"), **options}

    def result(self, name: str) -> dict:
        path = self.root / f"{name}.result.json"
        if not path.exists():
            # The log of the worker that had the job (it names each job as it starts it).
            logs = [log for log in worker_log(self.root, "*").parent.glob("vllm_*.log") if f"{name}:" in log.read_text() or name == "sync" == log.stem[5:]]
            ends = logs[0].read_text()[-3000:] if logs else "(none)"
            pytest.fail(f"vLLM left no result for {name}; its log ends:\n{ends}")
        result = json.loads(path.read_text())
        if "error" in result:
            pytest.fail(f"vLLM failed on {name}:\n{result['error']}")
        return result

    def made(self, families: list[str]) -> None:
        """Each family's HF model (its output layer at OUTPUT_STD), one after another (the generator's draws in
        order), then `hf-to-mcore` and `mcore-to-hf` of all of them side by side (processes of their own)."""
        from concurrent.futures import ThreadPoolExecutor

        from safetensors.torch import load_file, save_file

        from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

        for family in families:
            case, hf = FAMILY[family], self.root / family / "hf"
            try:
                # A copy: transformers' config classes rewrite a rope dict they are given in place.
                overrides = copy.deepcopy({**case.overrides, **case.vllm_overrides})
                make_hf_checkpoint(shrink(real_config(case.config), layers=case.layers, **overrides), hf, weight_std=0.1)
            except Exception as error:  # noqa: BLE001 (its cases fail with it)
                self.errors[family] = str(error)
                continue
            # The vLLM case's fields as given, where transformers' save wrote them otherwise (a transformers 5 config
            # holds OLMo 3's rope per layer type), as a release's config.json holds them.
            saved = json.loads((hf / "config.json").read_text())
            text = saved.get("text_config", saved)
            if any(text.get(key) != value for key, value in case.vllm_overrides.items()):
                text.update(case.vllm_overrides)
                (hf / "config.json").write_text(json.dumps(saved, indent=2))
            for path in hf.glob("*.safetensors"):
                tensors = load_file(path)
                if "lm_head.weight" in tensors:
                    tensors["lm_head.weight"] *= OUTPUT_STD / 0.1
                    save_file(tensors, path, metadata={"format": "pt"})

        def convert(family: str) -> None:
            hf, log = self.root / family / "hf", self.root / family / "convert.log"
            try:
                cli("hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(self.root / family / "mcore"), "--overwrite",
                    "--model-class", FAMILY[family].model_class, log=log)
                cli("mcore-to-hf", "--load-dir", str(self.root / family / "mcore"), "--save-dir", str(self.export(family)),
                    "--hf-config", str(hf), log=log)
            except Exception as error:  # noqa: BLE001
                self.errors[family] = str(error)

        with ThreadPoolExecutor(CONVERSIONS) as pool:
            list(pool.map(convert, [family for family in families if family not in self.errors]))

    def adapter(self, save: str) -> Path:
        """`adapter-to-hf` of a Megatron-Bridge adapter save (tests/fixtures/megatron_bridge_lora)."""
        out = self.root / "adapters" / save
        out.parent.mkdir(parents=True, exist_ok=True)
        cli("adapter-to-hf", "--load-dir", str(ADAPTER_SAVES / save / "checkpoint"), "--hf-config", str(ADAPTER_SAVES / base_of(save)),
            "--save-dir", str(out), "--overwrite", log=self.root / "adapters" / f"{save}.log")
        return out

    def quantized(self, kind: str) -> None:
        """A shrunk Qwen3 (FP8 block, INT4) or gpt-oss (MXFP4) wide enough for vLLM's kernels, quantized as a
        release stores it (tests/gpu/vllm_releases.py); hf-to-mcore; mcore-to-hf --quantize as-source; and the export
        with one quantized tensor's scales doubled (the fault)."""
        from vllm_releases import quantized_release, scales_doubled

        root = self.root / kind
        quantized_release(kind, root / "hf", root / "release")
        log = root / "convert.log"
        cli("hf-to-mcore", "--load-dir", str(root / "release"), "--save-dir", str(root / "mcore"), "--overwrite", log=log)
        cli("mcore-to-hf", "--load-dir", str(root / "mcore"), "--save-dir", str(root / "export"), "--hf-config",
            str(root / "release"), "--quantize", "as-source", "--dtype", "bf16", log=log)
        scales_doubled(root / "export", root / "fault")


def selected(items, name: str) -> list:
    return [item.callspec.params[name] for item in items if name in getattr(getattr(item, "callspec", None), "params", {})
            and item.get_closest_marker("skip") is None]


@pytest.fixture(scope="session")
def vllm_work(request, tmp_path_factory) -> Work:
    items = request.session.items
    served = selected(items, "vllm_case")
    families = list(dict.fromkeys(family for family, _ in served))
    tp2 = [family for family, layout in served if layout == "tp2"]
    quantized = list(dict.fromkeys(selected(items, "quantized_kind")))
    adapters = list(dict.fromkeys(selected(items, "adapter_save")))
    sync = any(item.originalname == "test_vllm_weight_sync_into_a_live_engine" for item in items if item.get_closest_marker("skip") is None)
    if sync and "qwen3" not in families:
        families.append("qwen3")
    base = Path(os.environ["MCONVERT_GPU_WORK"]) if os.environ.get("MCONVERT_GPU_WORK") else tmp_path_factory.mktemp("vllm")
    root = base / "vllm"
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + float(os.environ.get("MCONVERT_GPU_DEADLINE_S", "1200"))
    return Work(root, families, tp2, quantized, adapters, sync, deadline)


def first_mlp(model):
    """(name, module) of layer 0's MLP, or of its mixer where a hybrid model's first layer has no MLP (Nemotron-H's)."""
    import re

    for pattern in (r"layers\.0\.mlp$", r"layers\.0\.mixer$"):
        for name, module in model.named_modules():
            if re.search(pattern, name) and not re.search("vision|visual", name):  # the language model's, not the tower's
                return name, module
    raise LookupError("no layer 0 MLP or mixer")


def transformers_logprobs(hf: Path, sequences: list[list[int]], fault: bool = False, adapter: Path | None = None, bf16: bool = False):
    """Transformers' fp32 (or bf16) log-softmax at every position of each sequence, on the GPU (TF32 off), the model as
    mconvert verify builds it; with `adapter`, peft's model with that adapter; with `fault`, layer 0's MLP weights
    negated."""
    import torch

    from mconvert.verify.hf_side import load_hf_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_hf_model(hf, torch.bfloat16 if bf16 else torch.float32)
    if adapter is not None:
        # peft probes Transformer Engine at import; where the GPU tests installed it, its core library does not link in
        # a process whose torch has loaded its own cuDNN (libcudnn_heuristic: undefined symbol, 4 x H200). peft
        # needs none of it here.
        sys.modules.setdefault("transformer_engine", None)
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    model = model.cuda().eval()
    if fault:
        with torch.no_grad():
            for parameter in first_mlp(model)[1].parameters():
                parameter.neg_()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s], device="cuda")).logits[0].float(), -1).cpu() for s in sequences]


def against_transformers(hf: Path, prompts: list[list[int]], served: dict, fault: bool = False,
                         adapter: Path | None = None) -> tuple[float, float, dict]:
    """`compared` against transformers' fp32 logprobs of the prompts followed by vLLM's tokens."""
    return compared([transformers_logprobs(hf, continued(prompts, served), fault, adapter)], prompts, served)


def continued(prompts: list[list[int]], served: dict) -> list[list[int]]:
    """Each prompt followed by the tokens vLLM generated after it."""
    return [prompt + tokens for prompt, tokens in zip(prompts, served["tokens"])]


def compared(references: list, prompts: list[list[int]], served: dict) -> tuple[float, float, dict]:
    """(the largest gap between transformers' best logprob and that of vLLM's token, the largest difference between
    the two engines' logprobs of vLLM's tokens, where) over every generated position, each position against the
    nearest of `references` (transformers' logprobs at one precision or more). `where`: at the position of the largest
    difference, vLLM's token and logprob and each reference's logprob of it and best token; how many positions pass
    LOGPROB."""
    gap = difference = 0.0
    where: dict = {"positions": 0, "over_logprob_limit": 0}
    for index, (prompt, tokens, vllm_logprobs) in enumerate(zip(prompts, served["tokens"], served["logprobs"])):
        for step, (token, vllm_logprob) in enumerate(zip(tokens, vllm_logprobs)):
            rows = [reference[index][len(prompt) - 1 + step] for reference in references]
            gap = max(gap, min(float(row.max() - row[token]) for row in rows))
            here = min(abs(float(row[token]) - vllm_logprob) for row in rows)
            where["positions"] += 1
            where["over_logprob_limit"] += here > LOGPROB
            if here > difference:
                difference = here
                where.update(prompt=index, step=step, token=token, vllm_logprob=vllm_logprob, logprobs=[float(row[token]) for row in rows],
                             best=[int(row.argmax()) for row in rows], best_logprobs=[float(row.max()) for row in rows])
    return gap, difference, where


@pytest.mark.parametrize("vllm_case", cases())
def test_vllm_serves_the_export(vllm_case, vllm_work, record):
    family, layout = vllm_case
    if family in vllm_work.errors:
        pytest.fail(f"{family}'s model or conversion failed: {vllm_work.errors[family]}")
    served = vllm_work.result(f"{family}-{layout}")
    hf = vllm_work.root / family / "hf"
    # An MoE's routing in bf16 (gpu_cases.MOE_ROUTING_LOGPROB) moves both.
    limit, gap_limit = FAMILY[family].vllm_logprob or LOGPROB, FAMILY[family].vllm_logprob or GAP
    # vLLM runs in bf16: at a position where bf16 alone moves transformers' own logprobs (an expert chosen otherwise at
    # a near-tie of the router: Mixtral's and OLMoE's first runs parted from transformers' fp32 by 0.88 and 1.82, and
    # transformers' bf16 from its fp32 by 0.85 and 1.74 at the same positions, 4 x H200 and H200), vLLM is held to
    # transformers at the nearer of the two precisions.
    fp32, bf16 = (transformers_logprobs(hf, continued(vllm_work.prompts, served), bf16=half) for half in (False, True))
    gap, difference, where = compared([fp32, bf16], vllm_work.prompts, served)
    fp32_gap, fp32_difference, _ = compared([fp32], vllm_work.prompts, served)
    _, fault_difference, _ = against_transformers(hf, vllm_work.prompts, served, fault=True)
    record("max_logprob_gap", gap, gap_limit, gap <= gap_limit, seconds=served["seconds"], tokens=NEW_TOKENS, prompts=list(PROMPT_LENGTHS),
           where=where, against_fp32_only={"max_logprob_gap": fp32_gap, "max_logprob_difference": fp32_difference})
    record("max_logprob_difference", difference, limit, difference <= limit)
    record("fault_max_logprob_difference", fault_difference, limit, fault_difference > limit, fault="layer 0's MLP (or mixer) weights negated")
    assert gap <= gap_limit and difference <= limit, (gap, difference)
    assert fault_difference > limit, f"the check does not see layer 0's MLP weights negated ({fault_difference})"


@pytest.mark.parametrize("adapter_save", ADAPTERS)
def test_vllm_serves_the_exported_adapter(adapter_save, vllm_work, record):
    """vLLM serves `adapter-to-hf`'s export of a Megatron-Bridge adapter save as a LoRA request on the HF base, with
    peft + transformers' greedy tokens and logprobs; the base without the adapter (the fault) must part from them."""
    if adapter_save in vllm_work.errors:
        pytest.fail(f"adapter-to-hf of {adapter_save} failed: {vllm_work.errors[adapter_save]}")
    served = vllm_work.result(f"adapter-{adapter_save}")
    base, adapter = ADAPTER_SAVES / base_of(adapter_save), vllm_work.root / "adapters" / adapter_save
    gap, difference, where = against_transformers(base, vllm_work.adapter_prompts, served, adapter=adapter)
    _, fault_difference, _ = against_transformers(base, vllm_work.adapter_prompts, served)
    record("max_logprob_gap", gap, GAP, gap <= GAP, seconds=served["seconds"], tokens=NEW_TOKENS, prompts=list(PROMPT_LENGTHS),
           where=where)
    record("max_logprob_difference", difference, LOGPROB, difference <= LOGPROB)
    record("fault_max_logprob_difference", fault_difference, LOGPROB, fault_difference > LOGPROB, fault="the base without the adapter")
    assert gap <= GAP and difference <= LOGPROB, (gap, difference)
    assert fault_difference > LOGPROB, f"vLLM's tokens with the adapter are the base's own ({fault_difference})"


def compare(a: dict, b: dict) -> tuple[bool, float]:
    """(whether two runs' greedy tokens are all equal, the largest difference of their chosen tokens' logprobs)."""
    difference = max(abs(x - y) for r, e in zip(a["logprobs"], b["logprobs"]) for x, y in zip(r, e))
    return a["tokens"] == b["tokens"], difference


@pytest.mark.parametrize("quantized_kind", QUANTIZED)
def test_vllm_serves_the_quantized_export_as_the_release(quantized_kind, vllm_work, record):
    if quantized_kind in vllm_work.errors:
        pytest.fail(f"the {quantized_kind} release or its conversion failed: {vllm_work.errors[quantized_kind]}")
    release, export, fault = (vllm_work.result(f"{quantized_kind}-{which}") for which in ("release", "export", "fault"))
    equal, difference = compare(release, export)
    fault_equal, fault_difference = compare(release, fault)
    record("greedy_tokens_equal", equal, True, equal, seconds=export["seconds"])
    record("max_logprob_difference", difference, LOGPROB, difference <= LOGPROB)
    record("fault_max_logprob_difference", fault_difference, LOGPROB, not fault_equal or fault_difference > LOGPROB,
           fault="layer 0's down projection's scales doubled", tokens_equal=fault_equal)
    assert equal and difference <= LOGPROB, (release, export)
    assert not fault_equal or fault_difference > LOGPROB, "the export with doubled scales serves as the release"


# The engine's own weights back: the same bf16 values the export's files give, so the same logprobs but for the order
# of floating-point sums (none here: the same kernels on the same values).
SYNCED = 1e-3


@pytest.mark.parametrize("vllm_case", [pytest.param(("qwen3", "sync"), id="qwen3")])
def test_vllm_weight_sync_into_a_live_engine(vllm_case, vllm_work, record):
    if "qwen3" in vllm_work.errors:
        pytest.fail(f"qwen3's model or conversion failed: {vllm_work.errors['qwen3']}")
    result = vllm_work.result("sync")
    export = result["export"]
    _, perturbed = compare(export, result["perturbed"])
    equal, synced = compare(export, result["synced"])
    fault_equal, fault = compare(export, result["synced_with_fault"])
    record("perturbed_max_logprob_difference", perturbed, SYNCED, perturbed > SYNCED)
    record("synced_max_logprob_difference", synced, SYNCED, equal and synced <= SYNCED, tokens_equal=equal,
           tensors_pushed=len(result["pushed"]), seconds=result["seconds"])
    record("fault_max_logprob_difference", fault, SYNCED, fault > SYNCED, fault=f"{result['fault_tensor']} scaled by 1.5",
           tokens_equal=fault_equal)
    assert perturbed > SYNCED, "perturbing the engine's weights changed nothing: the test could not fail"
    assert equal and synced <= SYNCED, (equal, synced)
    assert fault > SYNCED, f"a sync with {result['fault_tensor']} scaled gives the export's logprobs"
