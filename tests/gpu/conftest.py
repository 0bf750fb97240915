"""GPU tests: marks, the skip where GPUs are too few, the session's work (gpu_evidence.py), and the results file.

    pytest -m gpu tests/gpu -k gpt_oss        # one family's evidence (bash scripts/gpu/run_gpu_tests.sh on a GPU box)

Marks: `gpu` (needs CUDA GPUs) and `gpus(n)` (needs n of them): skipped, with the count, where fewer are visible.
The CPU suite collects these tests and skips them without importing torch. Every checked metric is appended as one
JSON line to MCONVERT_GPU_RESULTS (default: gpu_results.jsonl in pytest's temporary folder):
family, layout, test, metric, value, threshold, pass, device, versions, date (and details); scripts/gpu/results_to_docs.py
makes docs/verification.md's tables of them.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_cases import FAMILY

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (tests/gpu; scripts/gpu/run_gpu_tests.sh runs them on a GPU box)")
    config.addinivalue_line("markers", "gpus(n): needs at least n CUDA GPUs visible; skipped where fewer are")


@functools.cache
def visible_gpus() -> int:
    """CUDA GPUs this process can use; without nvidia-smi none (and torch is not imported)."""
    if os.environ.get("MCONVERT_GPU_TESTS_DEVICE") == "cpu":
        return 1 << 30  # the rehearsal on CPU ranks: any count of ranks
    if shutil.which("nvidia-smi") is None:
        return 0
    import torch

    return torch.cuda.device_count()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        marker = item.get_closest_marker("gpus")
        needed = marker.args[0] if marker else 1
        if visible_gpus() < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), {visible_gpus()} visible"))


def selected_cases(items) -> tuple[list[tuple[str, str]], list[str]]:
    """The layout cases and training families of the tests that will run (after -k, -m and the skips)."""
    layout_cases, training = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("skip") is not None:
            continue
        if "case" in params:
            layout_cases.append(tuple(params["case"]))
        elif "training_family" in params:
            training.append(params["training_family"])
    return list(dict.fromkeys(layout_cases)), list(dict.fromkeys(training))


@pytest.fixture(scope="session")
def evidence(request, tmp_path_factory):
    """The session's work for the selected cases, started at the first test that asks for it."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core >= 0.19, Python >= 3.12)")
    from gpu_evidence import Evidence

    layout_cases, training = selected_cases(request.session.items)
    work = Path(os.environ["MCONVERT_GPU_WORK"]) if os.environ.get("MCONVERT_GPU_WORK") else tmp_path_factory.mktemp("gpu_evidence")
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + float(os.environ.get("MCONVERT_GPU_DEADLINE_S", "3000"))
    evidence = Evidence(work, layout_cases, training, deadline)
    try:
        evidence.start()
        yield evidence
    finally:
        evidence.stop()


def results_path(tmp_path_factory) -> Path:
    named = os.environ.get("MCONVERT_GPU_RESULTS")
    return Path(named) if named else tmp_path_factory.getbasetemp() / "gpu_results.jsonl"


@pytest.fixture(scope="session")
def environment() -> dict:
    """The machine and versions each result is stamped with."""
    import importlib.metadata

    import torch

    # The kernels' packages are installed where only the Megatron runs look (gpu_evidence._environment).
    # vLLM's packages likewise, where only the vLLM processes look (tests/gpu/test_vllm.py).
    path = sys.path + os.environ.get("MCONVERT_GPU_KERNELS_PATH", "").split(os.pathsep) + [os.environ.get("VLLM_SITE", "/tmp/site-vllm")]

    def version(name: str) -> str | None:
        return next((found.version for found in importlib.metadata.distributions(name=name, path=path)), None)

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        machine = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        machine = f"CPU ({os.cpu_count()} cores)"
    # A copy of the tree (a lent machine's) may have no git, or no .git: MCONVERT_COMMIT says the commit then.
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True) \
        if shutil.which("git") else subprocess.CompletedProcess([], 1, "")
    return {
        "device": machine,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": version("transformers"), "megatron-core": version("megatron-core"),
            "transformer-engine": version("transformer_engine"), "flash-linear-attention": version("flash_linear_attention"),
            "mamba_ssm": version("mamba_ssm"), "compressed-tensors": version("compressed_tensors"), "vllm": version("vllm"),
            "mconvert": version("mconvert"),
            "commit": os.environ.get("MCONVERT_COMMIT") or commit.stdout.strip() or None,
        },
    }


@pytest.fixture
def record(request, environment, tmp_path_factory):
    """record(metric, value, threshold, passed, **details): one JSON line of this test's case to the results file."""
    params = request.node.callspec.params
    if "case" in params or "vllm_case" in params or "sync_case" in params:  # (family, layout)
        family, layout = params.get("case") or params.get("vllm_case") or params["sync_case"]
    elif "quantized" in params:  # test_quantized_exports.py: (release, export or fault)
        family, layout = params["quantized"]
    elif "adapter_save" in params:  # test_vllm.py: a Megatron-Bridge adapter save, served at TP 1
        family, layout = f"adapter {params['adapter_save']}", "tp1"
    elif "training_family" in params:  # at its case's training layout
        family = params["training_family"]
        layout = FAMILY[family].training
    else:  # a quantized release's kind (tests/gpu/test_vllm.py), on one GPU
        family, layout = params["quantized_kind"], "tp1"
    path = results_path(tmp_path_factory)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(metric: str, value, threshold, passed: bool, **details) -> None:
        line = {
            "family": family, "layout": layout, "test": request.node.originalname, "metric": metric, "value": value,
            "threshold": threshold, "pass": bool(passed), **environment,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "details": details,
        }
        with open(path, "a") as results:
            results.write(json.dumps(line) + "\n")

    return write
