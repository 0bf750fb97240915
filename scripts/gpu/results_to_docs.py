"""docs/verification.md's GPU tables, made from the JSON lines tests/gpu writes (scripts/gpu/run_gpu_tests.sh).

    python scripts/gpu/results_to_docs.py gpu_results.jsonl... [--docs docs/verification.md] [--out FILE]
    python scripts/gpu/results_to_docs.py gpu_results.jsonl... --docs docs/performance.md

Each table lies between two marker lines of the document,
    <!-- gpu-tests:NAME begin ... -->
    <!-- gpu-tests:NAME end -->
and everything between them is replaced (the rest of the document is left as it is): `layouts` (each family at the
four-GPU layouts: Megatron-LM's load_checkpoint against transformers, mconvert verify), `training` (each
family's Megatron-LM training steps), `quantized` (transformers running each quantized export on one GPU) and `vllm`
(vLLM serving the exports, and weight sync into its engine); in docs/performance.md (--docs), `engine_sync` (weight sync
into a two-GPU vLLM engine, three ways, with figures). Where a metric of a case appears more than once, the latest
result stands.
Each table says the machine, versions and date of its results and the command that reruns them. Writes the
document in place, or to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEGIN = "<!-- gpu-tests:{name} begin (made by scripts/gpu/results_to_docs.py from tests/gpu's results: edits here are overwritten) -->"
END = "<!-- gpu-tests:{name} end -->"
MARKER = re.compile(r"^<!-- gpu-tests:(\w+) (begin|end)\b.*-->$")
COMMAND = "bash scripts/gpu/run_gpu_tests.sh"
LOGITS = "test_megatron_lm_load_checkpoint_gives_transformers_logits"
VERIFY = "test_mconvert_verify_passes_at_the_layout"
TRAINING = "test_megatron_lm_trains_from_the_conversion"
QUANTIZED_RUNS = "test_transformers_runs_the_quantized_export_within_the_formats_error"
QUANTIZED_LOADS = "test_transformers_loads_the_fp8_export_as_it_loads_the_release"
ENGINE_SYNC = "test_engine_sync_with_figures"
VLLM_SERVES, VLLM_QUANTIZED, VLLM_SYNC = ("test_vllm_serves_the_export", "test_vllm_serves_the_quantized_export_as_the_release",
                                          "test_vllm_weight_sync_into_a_live_engine")
VLLM_ADAPTER = "test_vllm_serves_the_exported_adapter"


def read_results(paths: list[Path]) -> list[dict]:
    """Every result line, the latest of each (family, layout, test, metric, and the way of a weight sync where it
    names one) kept, in the order first seen."""
    latest: dict[tuple, dict] = {}
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                result = json.loads(line)
                key = (result["family"], result["layout"], result["test"], result["metric"], (result.get("details") or {}).get("way"))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise SystemExit(f"results_to_docs: {path}:{number}: not a result line ({error})") from None
            if key not in latest or result.get("date", "") >= latest[key].get("date", ""):
                latest[key] = result
    return list(latest.values())


def number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(number(v) for v in value)
    if isinstance(value, float):
        if 0.999 <= value < 1:  # a cosine near 1: how far from it
            return f"1 - {1 - value:.2g}"
        return f"{value:.4g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2g}"
    return str(value)


def cell(result: dict | None, limit: str | None = None) -> str:
    """A metric's value (with its limit), **bold** where it failed; 'error' where its test found no value."""
    if result is None:
        return "not run"
    value = "error" if result["value"] is None else number(result["value"])
    text = f"{value} ({limit} {number(result['threshold'])})" if limit and result["threshold"] is not None else value
    return text if result["pass"] else f"**{text}**"


def row_result(results: list[dict | None]) -> str:
    found = [r for r in results if r is not None]
    if any(not r["pass"] for r in found):
        return "**FAIL**"
    return "PASS" if len(found) == len(results) else "incomplete"


def provenance(results: list[dict]) -> list[str]:
    """One line for each machine and set of versions the results came from."""
    runs: dict[str, list[str]] = {}
    for result in results:
        versions = result.get("versions") or {}
        named = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
        runs.setdefault(f"{result.get('device', 'unknown device')}; {named}", []).append(result.get("date", "")[:10])
    return [f"Measured {min(dates)}{' to ' + max(dates) if max(dates) != min(dates) else ''} on {run}." for run, dates in runs.items()]


def by_case(results: list[dict], test: str) -> dict[tuple[str, str], dict[str, dict]]:
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for result in results:
        if result["test"] == test:
            cases.setdefault((result["family"], result["layout"]), {})[result["metric"]] = result
    return cases


def layouts_table(results: list[dict]) -> list[str]:
    megatron_lm, verify = by_case(results, LOGITS), by_case(results, VERIFY)
    cases = list(dict.fromkeys([*megatron_lm, *verify]))
    lines = [
        "| family | layout | Megatron-LM's `load_checkpoint`: max abs logit diff | `mconvert verify`: worst KL | worst cosine | worst top-1 | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        ours, theirs = megatron_lm.get(case, {}), verify.get(case, {})
        metrics = [ours.get("megatron_lm_max_abs_logit_diff"), theirs.get("verify_kl"), theirs.get("verify_cosine"), theirs.get("verify_top1")]
        on_gpu = ((metrics[0] or {}).get("details") or {}).get("reference_device") == "cuda"
        aside = " (transformers on the GPU)" if on_gpu else ""
        lines.append(
            f"| {case[0]} | {case[1]} | {cell(metrics[0], '<=')}{aside} | {cell(metrics[1], '<=')} | {cell(metrics[2], '>=')} "
            f"| {cell(metrics[3], '>=')} | {row_result(metrics)} |"
        )
    return lines


def training_table(results: list[dict]) -> list[str]:
    cases = by_case(results, TRAINING)
    lines = [
        "| family | step losses at lr 0 | transformers | abs diff | losses at lr 1e-4 | export of the lr-0 save: differing tensors | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for (family, _), metrics in cases.items():
        step, learning, export = (metrics.get(name) for name in ("step_loss_abs_diff", "losses_at_lr_1e-4", "export_differing_tensors"))
        details = (step or {}).get("details", {})
        megatron = details.get("megatron") or {}
        tensors = (export or {}).get("details", {}).get("tensors")
        lines.append(
            f"| {family} | {number(list(megatron.values())) if megatron else '-'} | {number(details.get('transformers'))} "
            f"| {cell(step, '<=')} | {cell(learning)} | {cell(export)}{f' of {tensors}' if tensors else ''} "
            f"| {row_result([step, learning, export])} |"
        )
    return lines


def quantized_table(results: list[dict]) -> list[str]:
    runs, loads = by_case(results, QUANTIZED_RUNS), by_case(results, QUANTIZED_LOADS)
    lines = [
        "| release | transformers loads | max abs logit diff / max logit, against the bf16 export | top-1 agreement | weights unlike the release's | result |",
        "|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys([*runs, *loads]):
        run, load = runs.get(case, {}), loads.get(case, {})
        fault = "fault" in case[1]  # a fault injected: each limit must be exceeded
        metrics = [run.get("max_rel_logit_diff"), run.get("top1_agreement")]
        weights = load.get("weights_unlike_the_releases") if "FP8" in case[0] and not fault else None
        checked = metrics + ([weights] if "FP8" in case[0] and not fault else [])
        lines.append(
            f"| {case[0]} | {case[1]} | {cell(metrics[0], '>' if fault else '<=')} | {cell(metrics[1], '<' if fault else '>=')} "
            f"| {cell(weights) if len(checked) == 3 else '-'} | {row_result(checked)} |"
        )
    return lines


def vllm_table(results: list[dict]) -> list[str]:
    lines = ["| case | layout | check | measured | fault injected | result |", "|---|---|---|---|---|---|"]
    for (family, layout), metrics in by_case(results, VLLM_SERVES).items():
        gap, difference, fault = (metrics.get(n) for n in ("max_logprob_gap", "max_logprob_difference", "fault_max_logprob_difference"))
        lines.append(f"| {family} | {layout} | the export's greedy tokens against transformers' fp32: worst gap to its best; "
                     f"worst logprob difference | {cell(gap, '<=')}; {cell(difference, '<=')} | {cell(fault, '>')} "
                     f"| {row_result([gap, difference, fault])} |")
    for (save, layout), metrics in by_case(results, VLLM_ADAPTER).items():
        gap, difference, fault = (metrics.get(n) for n in ("max_logprob_gap", "max_logprob_difference", "fault_max_logprob_difference"))
        lines.append(f"| {save} | {layout} | adapter-to-hf's adapter as a LoRA request against peft + transformers' fp32: worst gap "
                     f"to its best; worst logprob difference | {cell(gap, '<=')}; {cell(difference, '<=')} | {cell(fault, '>')} "
                     f"| {row_result([gap, difference, fault])} |")
    for (kind, layout), metrics in by_case(results, VLLM_QUANTIZED).items():
        equal, difference, fault = (metrics.get(n) for n in ("greedy_tokens_equal", "max_logprob_difference", "fault_max_logprob_difference"))
        lines.append(f"| {kind} | {layout} | the export's greedy tokens equal to the release's; worst logprob difference "
                     f"| {cell(equal)}; {cell(difference, '<=')} | {cell(fault, '>')} | {row_result([equal, difference, fault])} |")
    for (family, _), metrics in by_case(results, VLLM_SYNC).items():
        perturbed, synced, fault = (metrics.get(n) for n in ("perturbed_max_logprob_difference", "synced_max_logprob_difference",
                                                              "fault_max_logprob_difference"))
        lines.append(f"| {family} | tp1 | weights perturbed, then synced from megatron-core by `gather_hf_weights`: worst "
                     f"logprob difference to the export's, perturbed; synced | {cell(perturbed, '>')}; {cell(synced, '<=')} "
                     f"| {cell(fault, '>')} | {row_result([perturbed, synced, fault])} |")
    return lines


def engine_sync_table(results: list[dict]) -> list[str]:
    """A row per model and way: its figures, and whether the synced engine generated as the export."""
    lines = ["| model | Megatron layout | way | s | GB/s per engine rank | GPU peak extra, MiB (rank 0, 1) "
             "| host peak extra, MiB (rank 0, 1) | synced engine = export | result |", "|---|---|---|---|---|---|---|---|---|"]
    rows: dict[tuple[str, str, str], dict[str, dict]] = {}
    faults: dict[tuple[str, str], dict] = {}
    for result in results:
        if result["test"] != ENGINE_SYNC:
            continue
        case = (result["family"], result["layout"])
        if result["metric"] == "fault_max_logprob_difference":
            faults[case] = result
        else:
            rows.setdefault((*case, result["details"].get("way", "")), {})[result["metric"]] = result
    for (family, layout, way), metrics in rows.items():
        figures, synced = metrics.get("sync_gb_per_s"), metrics.get("synced_max_logprob_difference")
        details = figures["details"] if figures else {}
        gpu, host = (", ".join("-" if value is None else f"{value:.0f}" for value in details.get(name, [])) or "-"
                     for name in ("gpu_extra_mib", "host_extra_mib"))
        seconds = f"{details['seconds']:.3f}" if "seconds" in details else "-"
        lines.append(f"| {family} | {layout} | {way} | {seconds} | {cell(figures)} | {gpu} | {host} | {cell(synced, '<=')} "
                     f"| {row_result([figures, synced, faults.get((family, layout))])} |")
    for (family, layout), fault in faults.items():
        lines.append(f"| {family} | {layout} | fault: {fault['details'].get('fault', '')} | - | - | - | - | {cell(fault, '>')} "
                     f"| {row_result([fault])} |")
    return lines


LAYOUTS_TEXT = (
    "Each family's model (tests/gpu/gpu_cases.py: a real config shrunk to hidden 64, 4 heads, 8 experts, random weights "
    "at std 0.1) converted on the CPU at each layout, then on four GPUs: Megatron-LM parses the printed MODEL_ARGS and "
    "LOAD_ARGS, builds the model as its pretrain_gpt.py (pretrain_hybrid.py) does under Transformer Engine and loads the "
    "checkpoint with its own `load_checkpoint`, strict; its fp32 logits of prompts longer than any window, top-k or Mamba "
    "chunk against transformers' fp32 logits on the CPU, within the limit shown (tests/gpu/test_layouts.py); and "
    "`mconvert verify --spec te` at the layout, within its fp32 limits (section Thresholds). TF32 off. A layout a family "
    "cannot take is skipped with the reason the case table gives."
)
TRAINING_TEXT = (
    "Each family's model (as above) trained by Megatron-LM's `pretrain` on one GPU from its fp32 conversion "
    "(scripts/gpu/gpu_train.py, checked by scripts/training/megatron_train_check.py; one global batch): the step "
    "losses at lr 0 against transformers' fp32 loss on the same tokens, within the limit shown, the lr-0 run's "
    "training save exported (`mconvert mcore-to-hf`) bit for bit, and at lr 1e-4 the loss falling at every step."
)
VLLM_TEXT = (
    "vLLM 0.25.0 (scripts/gpu/vllm_setup.sh) as the client of mconvert's exports, on one GPU (and two at TP 2), bf16: "
    "each family's model (as above, its output layer at std 0.5 for clear greedy choices) through hf-to-mcore and "
    "mcore-to-hf, served by vLLM (image-text models on text, `language_model_only`), its greedy tokens (16 after prompts "
    "of 12, 40 and 70 tokens) held to transformers' fp32 run fed the same tokens (MoE and delta-net families: within the "
    "limit gpu_cases declares for routing in bf16); Megatron-Bridge's adapter saves (tests/fixtures/megatron_bridge_lora) "
    "exported by adapter-to-hf and served as a LoRA request (expert adapters as PEFT's 3-D format, "
    "`enable_mixed_moe_lora_format`), held to peft's model on the base; FP8 block and INT4 pack-quantized releases of a "
    "shrunk Qwen3 and an MXFP4 release of a shrunk gpt-oss, exported with `--quantize as-source`, served beside the "
    "release; and mconvert's weight sync from a live megatron-core model into vLLM's engine (tests/gpu/test_vllm.py). Each "
    "check with its fault injected must fail. The rows here were judged against transformers' fp32 alone; Mixtral's and "
    "OLMoE's misses sit where transformers' own bf16 run parts from its fp32 as much (0.85 and 1.74, a router near-tie), "
    "and the test now holds each position to the nearer of the two precisions (not yet rerun). Gemma 3's fault row "
    "negated its vision tower's first MLP, not the language model's (fixed, not yet rerun). Qwen3-Next's shrunk model "
    "parts from itself by up to 13 between bf16 and fp32 in transformers alone, so bf16 serving cannot be judged at this "
    "size. Not served by vLLM 0.25.0 (test_vllm.NOT_SERVED): DeepSeek-V3.2 (its indexer needs DeepGEMM, not carried), "
    "Qwen3.5-MoE's text model (no causal-LM class), OLMo 3 (its Olmo3 reads one rope where the machines' transformers "
    "5.17 holds one per layer type)."
)
QUANTIZED_TEXT = (
    "A block-FP8 DeepSeek-V3 release (128 x 128 blocks) and a pack-quantized INT4 Kimi-K2-Thinking release (groups of "
    "32), shrunk, random weights at std 0.1, each converted to Megatron (fp32) and exported back twice, in bf16 and "
    "with `--quantize as-source` (tests/gpu/test_quantized_exports.py). transformers loads both exports on one GPU in "
    "bf16 (FP8 through its fine-grained FP8 integration with `dequantize=True`, since its FP8 matmul kernels come from "
    "the Hub; INT4 through its compressed-tensors integration, which decompresses the experts with compressed-tensors as they load) and runs 2 x 96 tokens: the largest logit difference "
    "relative to the largest logit and the top-1 agreement, within the format's error (the limits and how they are "
    "derived: the test's FORMAT_ERROR). The FP8 export loads to the release's weights, every one. Fault injection: the "
    "export with every scale doubled must exceed each limit."
)
ENGINE_SYNC_TEXT = (
    "Weight sync from a live Megatron model into a running vLLM 0.25.0 engine on two GPUs, as colocated RL runs it (a "
    "Megatron rank and a vLLM TP 2 engine rank in each process, vLLM's external launcher): a dense Qwen3 (hidden 1024, "
    "8 layers, 0.39 GB in bf16) at Megatron TP 2 and a DeepSeek-V3 MoE at its released attention dims (0.30 GB) at EP "
    "2, their weights handed to the engine's `load_weights` by mconvert's `gather_hf_weights` (each rank gathers each "
    "whole HF tensor from its group), by a gather of every tensor to rank 0's host and then a send of each to every "
    "engine rank, and by 512 MB buckets packed on rank 0 and broadcast (tests/gpu/test_engine_sync.py). Seconds: median "
    "of 3, slowest rank; GB/s: whole HF tensors delivered to each engine rank; peak extra: beyond what the rank held "
    "before the sync (GPU: torch.cuda.max_memory_allocated, trainer and engine together; host: peak RSS). After each "
    "way the engine must generate the export's greedy tokens and logprobs (its weights perturbed first); the fault, one "
    "tensor scaled by 1.5, must not."
)
# name: (the test file, its tests, what they do, the table of their results, the GPUs it needs, its -k)
SECTIONS = {
    "layouts": ("tests/gpu/test_layouts.py", (LOGITS, VERIFY), LAYOUTS_TEXT, layouts_table, "four GPUs", "FAMILY"),
    "training": ("tests/gpu/test_training.py", (TRAINING,), TRAINING_TEXT, training_table, "one GPU", "FAMILY"),
    "quantized": ("tests/gpu/test_quantized_exports.py", (QUANTIZED_RUNS, QUANTIZED_LOADS), QUANTIZED_TEXT, quantized_table, "one GPU", "quantized_exports"),
    "engine_sync": ("tests/gpu/test_engine_sync.py", (ENGINE_SYNC,), ENGINE_SYNC_TEXT, engine_sync_table, "two GPUs and vLLM installed", "engine_sync"),
    "vllm": ("tests/gpu/test_vllm.py", (VLLM_SERVES, VLLM_ADAPTER, VLLM_QUANTIZED, VLLM_SYNC), VLLM_TEXT, vllm_table, "one GPU (two for TP 2) and vLLM installed", "vllm"),
}


def section(name: str, results: list[dict]) -> list[str]:
    source, tests, text, table, gpus, selection = SECTIONS[name]
    mine = [result for result in results if result["test"] in tests]
    run = COMMAND if selection == "FAMILY" else f"{COMMAND} -k {selection}"
    if not mine:
        return [*wrapped(text), "", f"Not yet run: `{run}` on a machine with {gpus} runs {source}."]
    one_family = f"; `{COMMAND} -k FAMILY` for one family" if selection == "FAMILY" else ""
    command = f"Command: `{run}` ({source}{one_family})."
    return [*wrapped(text), "", *provenance(mine), command, "", *table(mine)]


def wrapped(text: str) -> list[str]:
    """Prose at the document's width."""
    return textwrap.wrap(text, 118, break_on_hyphens=False, break_long_words=False)


def replace_sections(text: str, results: list[dict], source: str) -> str:
    """The document with every marked section made anew; a marker without its pair is an error."""
    out, inside = [], None
    for number_, line in enumerate(text.splitlines(), 1):
        found = MARKER.match(line.strip())
        if inside is None:
            out.append(line)
            if found and found.group(2) == "begin":
                if found.group(1) not in SECTIONS:
                    raise SystemExit(f"results_to_docs: {source}:{number_}: no table is named {found.group(1)} ({', '.join(SECTIONS)})")
                inside = found.group(1)
                out[-1] = BEGIN.format(name=inside)
                out += section(inside, results)
            elif found:
                raise SystemExit(f"results_to_docs: {source}:{number_}: an end marker without its begin")
        elif found and found.groups() == (inside, "end"):
            out.append(END.format(name=inside))
            inside = None
        elif found:
            raise SystemExit(f"results_to_docs: {source}:{number_}: marker inside section {inside}")
    if inside is not None:
        raise SystemExit(f"results_to_docs: {source}: section {inside} has no end marker")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "verification.md")
    parser.add_argument("--out", type=Path, help="write the document here (default: in place)")
    options = parser.parse_args()
    missing = [str(path) for path in options.results if not path.exists()]
    if missing:
        raise SystemExit(f"results_to_docs: no such results file: {', '.join(missing)}")
    text = options.docs.read_text()
    made = replace_sections(text, read_results(options.results), str(options.docs))
    (options.out or options.docs).write_text(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
