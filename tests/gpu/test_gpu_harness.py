"""The GPU evidence's harness, on the CPU (no GPU mark: the CPU suite runs these): the case table covers every family
mconvert converts, the GPU tests are collected and skipped without GPUs (and without importing torch), the results
file's lines make docs/verification.md's tables (scripts/gpu/results_to_docs.py), the launcher's dry run selects
what `-k` names, and the weight sync's three ways (tests/gpu/sync_ways.py) deliver the export's tensors on CPU ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_engine_sync
import test_vllm
from gpu_cases import EIGHT_GPUS, FAMILIES, FAMILY, LAYOUTS, SHOWN_LAYOUTS, layout_cases, training_cases

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "scripts" / "gpu" / "results_to_docs.py"


def test_every_family_mconvert_converts_has_a_case_and_every_layout_a_reason():
    from mconvert.mappings import FAMILIES as MAPPED

    assert {family.family or family.name for family in FAMILIES} == set(MAPPED)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        assert set(family.layouts) <= set(LAYOUTS), family.name
        assert set(SHOWN_LAYOUTS) - set(family.layouts) == set(family.skipped), family.name
        assert all(LAYOUTS[name].world == 4 for name in family.layouts), family.name
    assert ("gpt_oss", "tp2ep2", "biased experts: megatron-core takes them at ETP 1 only (tp2ep4etp1 instead)") in layout_cases()
    assert ("gpt_oss", "tp2pp2etp1", None) in layout_cases()


def test_the_eight_gpu_cases_take_eight_ranks_at_the_widths_people_train():
    assert {name for family in EIGHT_GPUS for name in family.layouts} == {"ep8", "tp8", "tp2ep4", "tp4ep2"}
    assert all(LAYOUTS[name].world == 8 for family in EIGHT_GPUS for name in family.layouts)
    assert FAMILY["qwen3_30b_ep8"].overrides["num_experts"] == 128 and FAMILY["qwen3_30b_ep8"].overrides["hidden_size"] == 2048
    assert ("qwen3_30b_ep8", "ep8") in training_cases() and ("llama", "tp1") in training_cases()
    assert {family.name for family in EIGHT_GPUS} & {family.name for family in FAMILIES} == set()


def run_pytest(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """pytest in a process of its own, reporting which heavy modules collecting and skipping imported."""
    probe = (
        "import sys, pytest; code = pytest.main(sys.argv[1:]); "
        "print('imported:', sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules)); sys.exit(code)"
    )
    return subprocess.run([sys.executable, "-c", probe, "-p", "no:cacheprovider", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PATH": os.path.dirname(sys.executable), **(env or {})})


def test_without_gpus_the_gpu_tests_are_skipped_with_the_count_and_nothing_heavy_imported():
    run = run_pytest("-m", "gpu", "tests/gpu", "-q", "-rs")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    families, layouts = len(training_cases()), len(layout_cases())
    quantized = 4 + 1  # test_quantized_exports.py: two releases, each as exported and with a fault; the FP8 weights
    # tests/gpu/test_vllm.py: every family (served or not), TP 2, the adapters, the quantized releases, the sync.
    vllm = len(test_vllm.SERVED) + len(test_vllm.NOT_SERVED) + len(test_vllm.TP2) + len(test_vllm.ADAPTERS) + len(test_vllm.QUANTIZED) + 1
    mxfp4 = 1  # test_mxfp4_quantizer.py
    sync = len(test_engine_sync.CASES)
    assert f"{2 * layouts + families + quantized + vllm + mxfp4 + sync} skipped" in run.stdout, run.stdout[-2000:]
    assert "needs 4 CUDA GPU(s), 0 visible" in run.stdout and "needs 1 CUDA GPU(s), 0 visible" in run.stdout
    assert "dense: no experts" in run.stdout  # the case table's reasons, where the GPU count does not come first
    assert "imported: []" in run.stdout


def test_k_selects_one_familys_cases():
    run = run_pytest("-m", "gpu", "tests/gpu", "-k", "gpt_oss", "--collect-only", "-q")
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert collected and all("gpt_oss" in line for line in collected), run.stdout
    # Megatron-LM and verify at five layouts (two shown skipped), the training test, and vLLM serving its export.
    assert len(collected) == 2 * 5 + 1 + 1


def result(family, layout, test, metric, value, threshold, passed, date="2026-11-27T10:00:00+00:00", **details):
    return {"family": family, "layout": layout, "test": test, "metric": metric, "value": value, "threshold": threshold,
            "pass": passed, "device": "4 x NVIDIA H100 80GB HBM3",
            "versions": {"torch": "2.11.0+cu130", "transformer-engine": "2.20.2", "megatron-core": "0.19.2"},
            "date": date, "details": details}


LOGITS = "test_megatron_lm_load_checkpoint_gives_transformers_logits"
VERIFY = "test_mconvert_verify_passes_at_the_layout"
TRAINING = "test_megatron_lm_trains_from_the_conversion"
RUNS = "test_transformers_runs_the_quantized_export_within_the_formats_error"
SAMPLE = [
    result("gpt_oss", "tp2pp2", LOGITS, "megatron_lm_max_abs_logit_diff", 3.1e-6, 4.2e-4, True),
    result("gpt_oss", "tp2pp2", VERIFY, "verify_kl", 2e-11, 1e-5, True),
    result("gpt_oss", "tp2pp2", VERIFY, "verify_cosine", 0.9999999, 0.99999, True),
    result("gpt_oss", "tp2pp2", VERIFY, "verify_top1", 1.0, 0.99, True),
    # A first run's failure, then the rerun's pass: the later stands.
    result("qwen3_moe", "ep4", LOGITS, "megatron_lm_max_abs_logit_diff", 0.31, 4.1e-4, False),
    result("qwen3_moe", "ep4", LOGITS, "megatron_lm_max_abs_logit_diff", 2.2e-6, 4.1e-4, True, date="2026-11-28T09:00:00+00:00"),
    result("qwen3_moe", "ep4", VERIFY, "verify_kl", None, 1e-5, False, error="the torchrun ended (exit 1) in this job"),
    result("gpt_oss", "tp1", TRAINING, "step_loss_abs_diff", 7.2e-7, 1e-4, True,
           megatron={"1": 6.9084, "2": 6.9084}, transformers=6.90839),
    result("gpt_oss", "tp1", TRAINING, "losses_at_lr_1e-4", [6.908, 6.52, 6.1, 5.7], "each step below the one before", True),
    result("gpt_oss", "tp1", TRAINING, "export_differing_tensors", 0, 0, True, tensors=37),
    result("deepseek-v3 FP8 blocks", "export", RUNS, "max_rel_logit_diff", 0.0, 2**-5, True),
    result("deepseek-v3 FP8 blocks", "export", RUNS, "top1_agreement", 1.0, 0.95, True),
    result("deepseek-v3 FP8 blocks", "export", "test_transformers_loads_the_fp8_export_as_it_loads_the_release",
           "weights_unlike_the_releases", 0, 0, True),
    # A fault injected: the check passes where each metric is beyond its limit, and fails where one is not.
    result("kimi-k2-thinking INT4", "scales x2 (fault injected)", RUNS, "max_rel_logit_diff", 0.71, 0.25, True),
    result("kimi-k2-thinking INT4", "scales x2 (fault injected)", RUNS, "top1_agreement", 0.8, 0.7, False),
]
DOC = """# Title

Prose before, kept.

<!-- gpu-tests:layouts begin -->
| old | hand-copied |
<!-- gpu-tests:layouts end -->

Prose between, kept.

<!-- gpu-tests:quantized begin -->
<!-- gpu-tests:quantized end -->

<!-- gpu-tests:training begin -->
<!-- gpu-tests:training end -->
Prose after.
"""


def generate(tmp_path: Path, doc: str, results: list[dict]) -> subprocess.CompletedProcess:
    (tmp_path / "doc.md").write_text(doc)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    return subprocess.run([sys.executable, str(GENERATOR), str(tmp_path / "results.jsonl"), "--docs", str(tmp_path / "doc.md")],
                          capture_output=True, text=True)


def test_the_generator_makes_the_tables_between_the_markers_and_keeps_the_prose(tmp_path):
    run = generate(tmp_path, DOC, SAMPLE)
    assert run.returncode == 0, run.stderr
    made = (tmp_path / "doc.md").read_text()
    assert "hand-copied" not in made
    for kept in ("# Title\n\nProse before, kept.\n", "Prose between, kept.", "<!-- gpu-tests:training end -->\nProse after.\n"):
        assert kept in made
    lines = made.splitlines()
    assert "| gpt_oss | tp2pp2 | 3.1e-06 (<= 0.00042) | 2e-11 (<= 1e-05) | 1 - 1e-07 (>= 1 - 1e-05) | 1 (>= 0.99) | PASS |" in lines
    # The later run's pass stands; the verify that failed with no value says so, bold, and fails the row.
    assert "| qwen3_moe | ep4 | 2.2e-06 (<= 0.00041) | **error (<= 1e-05)** | not run | not run | **FAIL** |" in lines
    assert "| gpt_oss | 6.908, 6.908 | 6.908 | 7.2e-07 (<= 0.0001) | 6.908, 6.52, 6.1, 5.7 | 0 of 37 | PASS |" in lines
    assert "Measured 2026-11-27 to 2026-11-28 on 4 x NVIDIA H100 80GB HBM3; torch 2.11.0+cu130, transformer-engine 2.20.2, " \
           "megatron-core 0.19.2." in lines
    assert "| deepseek-v3 FP8 blocks | export | 0 (<= 0.03125) | 1 (>= 0.95) | 0 | PASS |" in lines
    assert "| kimi-k2-thinking INT4 | scales x2 (fault injected) | 0.71 (> 0.25) | **0.8 (< 0.7)** | - | **FAIL** |" in lines
    assert "Command: `bash scripts/gpu/run_gpu_tests.sh -k quantized_exports` (tests/gpu/test_quantized_exports.py)." in lines
    # Made again from the same results, the document does not change.
    again = generate(tmp_path, made, SAMPLE)
    assert again.returncode == 0 and (tmp_path / "doc.md").read_text() == made


SERVES, QUANTIZED, SYNC = ("test_vllm_serves_the_export", "test_vllm_serves_the_quantized_export_as_the_release",
                            "test_vllm_weight_sync_into_a_live_engine")
VLLM_SAMPLE = [
    result("qwen3", "tp1", SERVES, "max_logprob_gap", 0.031, 0.25, True),
    result("qwen3", "tp1", SERVES, "max_logprob_difference", 0.02, 0.25, True),
    result("qwen3", "tp1", SERVES, "fault_max_logprob_difference", 4.2, 0.25, True),
    result("int4", "tp1", QUANTIZED, "greedy_tokens_equal", True, True, True),
    result("int4", "tp1", QUANTIZED, "max_logprob_difference", 0.01, 0.25, True),
    result("int4", "tp1", QUANTIZED, "fault_max_logprob_difference", 1.3, 0.25, True),
    result("qwen3", "sync", SYNC, "perturbed_max_logprob_difference", 3.0, 1e-3, True),
    result("qwen3", "sync", SYNC, "synced_max_logprob_difference", 0.0, 1e-3, True),
    result("qwen3", "sync", SYNC, "fault_max_logprob_difference", 0.0, 1e-3, False),
]


def test_the_generator_makes_the_vllm_table(tmp_path):
    run = generate(tmp_path, "<!-- gpu-tests:vllm begin -->\n<!-- gpu-tests:vllm end -->\n", VLLM_SAMPLE)
    assert run.returncode == 0, run.stderr
    lines = (tmp_path / "doc.md").read_text().splitlines()
    assert any(line.startswith("| qwen3 | tp1 | the export's") and line.endswith("| 0.031 (<= 0.25); 0.02 (<= 0.25) | 4.2 (> 0.25) | PASS |")
               for line in lines), lines
    assert any(line.startswith("| int4 | tp1 |") and line.endswith("| True; 0.01 (<= 0.25) | 1.3 (> 0.25) | PASS |") for line in lines), lines
    # The sync whose fault went unseen fails its row.
    assert any(line.startswith("| qwen3 | tp1 | weights perturbed") and line.endswith("| 3 (> 0.001); 0 (<= 0.001) | **0 (> 0.001)** | **FAIL** |")
               for line in lines), lines


ENGINE_SYNC = "test_engine_sync_with_figures"


def sync_figures(way, gb_per_s, synced, passed=True):
    figures = dict(way=way, seconds=0.25, gpu_extra_mib=[812.4, 790.0], host_extra_mib=[12.0, 3.0])
    return [result("deepseek", "ep2", ENGINE_SYNC, "sync_gb_per_s", gb_per_s, None, True, **figures),
            result("deepseek", "ep2", ENGINE_SYNC, "synced_max_logprob_difference", synced, 1e-3, passed, way=way)]


def test_the_generator_makes_the_engine_sync_table(tmp_path):
    sample = [*sync_figures("gather_hf_weights", 1.2, 0.0), *sync_figures("512 MB buckets", 0.9, 0.5, passed=False),
              result("deepseek", "ep2", ENGINE_SYNC, "fault_max_logprob_difference", 2.0, 1e-3, True, fault="x scaled by 1.5")]
    run = generate(tmp_path, "<!-- gpu-tests:engine_sync begin -->\n<!-- gpu-tests:engine_sync end -->\n", sample)
    assert run.returncode == 0, run.stderr
    lines = (tmp_path / "doc.md").read_text().splitlines()
    assert "| deepseek | ep2 | gather_hf_weights | 0.250 | 1.2 | 812, 790 | 12, 3 | 0 (<= 0.001) | PASS |" in lines, lines
    # A way whose engine did not generate as the export fails its row; the fault has a row of its own.
    assert "| deepseek | ep2 | 512 MB buckets | 0.250 | 0.9 | 812, 790 | 12, 3 | **0.5 (<= 0.001)** | **FAIL** |" in lines, lines
    assert "| deepseek | ep2 | fault: x scaled by 1.5 | - | - | - | - | 2 (> 0.001) | PASS |" in lines, lines
    assert "Command: `bash scripts/gpu/run_gpu_tests.sh -k engine_sync` (tests/gpu/test_engine_sync.py)." in lines


def test_the_generator_refuses_a_section_without_its_end_marker_in_one_line(tmp_path):
    run = generate(tmp_path, DOC.replace("<!-- gpu-tests:training end -->\n", ""), SAMPLE)
    assert run.returncode == 1 and run.stderr.strip() == f"results_to_docs: {tmp_path / 'doc.md'}: section training has no end marker"
    assert (tmp_path / "doc.md").read_text() == DOC.replace("<!-- gpu-tests:training end -->\n", "")


def test_the_generator_changes_only_verification_mds_marked_sections(tmp_path):
    doc = (REPO / "docs" / "verification.md").read_text()
    assert doc.count("<!-- gpu-tests:") == 8  # the four sections, begun and ended
    run = generate(tmp_path, doc, SAMPLE)
    assert run.returncode == 0, run.stderr
    made = (tmp_path / "doc.md").read_text()

    def outside(text: str) -> list[str]:
        kept, inside = [], False
        for line in text.splitlines():
            if line.startswith("<!-- gpu-tests:"):
                inside = " begin" in line
            elif not inside:
                kept.append(line)
        return kept

    assert outside(made) == outside(doc)
    assert "| gpt_oss | tp2pp2 |" in made


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher is a bash script for Linux GPU machines")
def test_the_launchers_dry_run_shows_what_it_would_run_and_selects_by_k(tmp_path):
    launcher = REPO / "scripts" / "gpu" / "run_gpu_tests.sh"
    assert subprocess.run(["bash", "-n", str(launcher)]).returncode == 0
    run = subprocess.run(["bash", str(launcher), "--dry-run", "-k", "qwen3_moe"], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "would run: " in run.stdout and "-m gpu tests/gpu -k qwen3_moe" in run.stdout
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    # Three layouts, training, and vLLM serving the export at TP 1 and TP 2.
    assert len(collected) == 2 * 3 + 1 + 2 and all("qwen3_moe" in line for line in collected)
    assert (tmp_path / "gpu_tests.log").exists()


def delivered_by_each_way(mcore: str, export: str, fault: str) -> dict:
    """On each CPU rank (gloo): the conversion loaded at its layout, and what each way of sync_ways hands `load`,
    against the export's tensors; then the fault's. Every rank's findings, gathered."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from sync_ways import sync_ways

    from mconvert.mcore.checkpoint import RELEASE, read_args
    from mconvert.verify.megatron_side import load_model

    (model,) = load_model(mcore, read_args(Path(mcore) / RELEASE), torch.bfloat16, device="cpu", transformer_impl="local")
    config = json.loads((Path(export) / "config.json").read_text())
    want = {name: tensor for path in Path(export).glob("*.safetensors") for name, tensor in load_file(path).items()}
    received: dict = {}
    # Buckets of 256 KiB: the shrunk model's largest tensor (128 KiB) fits, and its weights take several.
    ways = sync_ways(model, config, lambda weights: received.update((name, tensor.clone()) for name, tensor in weights), torch.device("cpu"),
                     bucket_bytes=256 << 10)
    found = {}
    for name, way in [*ways.items(), ("fault", lambda: ways["gather_hf_weights"](fault))]:
        received.clear()
        delivered = way()
        found[name] = {"unlike": sorted(n for n in want if n not in received or not torch.equal(received[n], want[n])),
                       "extra": sorted(set(received) - set(want)), "bytes": delivered == sum(t.nbytes for t in received.values())}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return everyone


def test_each_sync_way_delivers_the_exports_tensors_on_cpu_ranks(tmp_path):
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
    from mconvert.verify.distributed import run_ranks

    make_hf_checkpoint(shrink(real_config("qwen3-8b")), tmp_path / "hf", dtype="bfloat16", weight_std=0.1)
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", parallelism=Parallelism(tp=2))
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "export", hf_config_dir=tmp_path / "hf")
    fault = "model.layers.1.mlp.down_proj.weight"
    ranks = run_ranks(delivered_by_each_way, str(tmp_path / "mcore"), str(tmp_path / "export"), fault, tp=2, device="cpu", timeout_s=300)
    assert len(ranks) == 2
    for found in ranks:
        for way in test_engine_sync.WAYS:
            assert found[way] == {"unlike": [], "extra": [], "bytes": True}, (way, found[way])
        assert found["fault"] == {"unlike": [fault], "extra": [], "bytes": True}
