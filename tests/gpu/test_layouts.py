"""Each family at the four-GPU layouts, as a user trains it: the conversion at the layout, loaded by Megatron-LM's own
model builder and `load_checkpoint` under Transformer Engine, gives transformers' logits; `mconvert verify` at the
layout passes. The work is done once for all selected cases (gpu_evidence.py); each test checks its case's files.
"""

from __future__ import annotations

import json

import pytest
from gpu_cases import FAMILY, LAYOUTS, case_id, layout_cases

pytestmark = pytest.mark.gpu

CASES = [
    pytest.param(
        (family, layout), id=case_id(family, layout),
        marks=[pytest.mark.gpus(LAYOUTS[layout].world), *([pytest.mark.skip(reason=why)] if why else [])],
    )
    for family, layout, why in layout_cases()
]
# Megatron-LM's fp32 logits against transformers' fp32 logits on the CPU, as torch.testing.assert_close(rtol, atol)
# would hold them at the largest logit, rtol the family's (1e-4 but for gated delta-net: gpu_cases.py): what the CPU
# tests hold them to (tests/megatron_lm/test_megatron_lm.py). TF32 is off (NVIDIA_TF32_OVERRIDE=0): Transformer
# Engine's TF32 GEMMs alone move logits by 1e-3 of their scale.
ATOL = 1e-4


def settled(outcome, record, metric: str):
    """The outcome's file, or the test skipped (not run) or failed (the work's error), its result recorded."""
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    if outcome.error:
        record(metric, None, None, False, error=outcome.error[-2000:])
        pytest.fail(outcome.error, pytrace=False)
    return outcome.path


@pytest.mark.parametrize("case", CASES)
def test_megatron_lm_load_checkpoint_gives_transformers_logits(case, evidence, record):
    import torch

    family, layout = case
    metric = "megatron_lm_max_abs_logit_diff"
    logits = torch.load(settled(evidence.layout_outcome(family, layout, "megatron_lm"), record, metric))
    reference = torch.load(settled(evidence.reference(family), record, metric))
    logits = logits[..., : reference.shape[-1]]  # Megatron's vocabulary padding cut
    limit = ATOL + FAMILY[family].logit_rtol * reference.abs().max().item()
    per_position = (logits - reference).abs().amax(-1).flatten()
    difference = per_position.max().item()
    record(metric, difference, limit, difference <= limit, spec=evidence.spec, tokens=list(reference.shape[:2]),
           logit_scale=reference.abs().max().item(), top1_agreement=(logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
           positions_over_limit=int((per_position > limit).sum()), reference_device=evidence.reference_device(family))
    assert difference <= limit, f"{family} at {layout}: max |logit difference| {difference:.3g} > {limit:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_mconvert_verify_passes_at_the_layout(case, evidence, record):
    from mconvert.verify.compare import FP32

    family, layout = case
    report_file = settled(evidence.layout_outcome(family, layout, "verify"), record, "verify_kl")
    code = int(report_file.with_suffix(".exit").read_text())
    log = report_file.with_suffix(".log").read_text(errors="replace") if report_file.with_suffix(".log").exists() else ""
    if not report_file.exists():
        record("verify_kl", None, FP32.max_kl, False, exit=code, output=log[-2000:])
        pytest.fail(f"mconvert verify exit {code}, no report:\n{log[-3000:]}", pytrace=False)
    report = json.loads(report_file.read_text())
    prompts = report["prompts"]
    worst = {
        "verify_kl": (max(p["kl"] for p in prompts), FP32.max_kl, lambda v, t: v <= t),
        "verify_cosine": (min(p["cosine"] for p in prompts), FP32.min_cosine, lambda v, t: v >= t),
        "verify_top1": (min(p["top1_agreement"] for p in prompts), FP32.min_top1, lambda v, t: v >= t),
    }
    details = dict(exit=code, spec=report["spec"], prompt_tokens=[p["tokens"] for p in prompts],
                   max_abs_diff=max(p["max_abs_diff"] for p in prompts), notes=report["notes"],
                   first_diverging_layer=report["first_diverging_layer"])
    for metric, (value, threshold, within) in worst.items():
        record(metric, value, threshold, within(value, threshold) and code == 0, **details)
    assert code == 0 and report["passed"], f"mconvert verify exit {code}:\n{log[-3000:]}"
    for metric, (value, threshold, within) in worst.items():
        assert within(value, threshold), f"{metric} {value:.3g} beyond {threshold:g}"
