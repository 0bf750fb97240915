"""Each family trained by Megatron-LM's own pretrain from its conversion, on one GPU or at its case's layout
(gpu_cases.Family.training; scripts/gpu/gpu_train.py and the check it runs, scripts/training/megatron_train_check.py): at lr 0 the step losses are transformers' loss on the same
tokens, the run's --lr 0 save exports to the HF model bit for bit, and at a real learning rate the loss falls at every
step. gpu_train.py runs the families side by side over the GPUs (gpu_evidence.py); each test checks its family's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from gpu_cases import LAYOUTS, training_cases

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("training_family", [
    pytest.param(family, id=family, marks=pytest.mark.gpus(LAYOUTS[layout].world)) for family, layout in training_cases()])
def test_megatron_lm_trains_from_the_conversion(training_family, evidence, record):
    sys.path.insert(0, str(REPO / "scripts" / "training"))
    from megatron_train_check import FP32_LOSS_TOLERANCE

    outcome = evidence.training_outcome(training_family)
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    if outcome.error:
        record("step_loss_abs_diff", None, FP32_LOSS_TOLERANCE, False, error=outcome.error[-2000:])
        pytest.fail(outcome.error, pytrace=False)
    result = json.loads(outcome.path.read_text().splitlines()[-1])
    check = result.get("check", {})
    logs = {key: result[key][-2000:] for key in ("convert_output", "lr0_log", "trained_log", "check_log") if result.get(key)}
    common = dict(megatron_flags=result.get("megatron_flags"), transformer_engine=result.get("transformer_engine"),
                  lr0_exit=result.get("lr0_exit"), trained_exit=result.get("trained_exit"), **logs)

    loss = check.get("loss") or {}
    step = loss.get("max_abs_diff")
    # fp32 runs only: the tolerance is for fp32 logits (megatron_train_check.py says why 1e-4).
    step_passed = step is not None and loss.get("dtype") == "float32" and step <= FP32_LOSS_TOLERANCE
    record("step_loss_abs_diff", step, FP32_LOSS_TOLERANCE, step_passed, megatron=loss.get("megatron"),
           transformers=loss.get("hf_fp32_with_padding_logits"), dtype=loss.get("dtype"), **common)

    learning = list((check.get("learning") or {}).get("megatron", {}).values())
    falls = len(learning) > 1 and all(later < earlier for earlier, later in zip(learning, learning[1:]))
    record("losses_at_lr_1e-4", learning, "each step below the one before", falls)

    export = check.get("export") or {}
    differing = len(export.get("differing", [])) + len(export.get("missing", [])) + len(export.get("extra", []))
    exported = bool(export.get("passed"))
    record("export_differing_tensors", differing if export else None, 0, exported, tensors=export.get("tensors"),
           dtypes=export.get("dtypes"), error=export.get("error"))

    assert step_passed, f"step losses {loss.get('megatron')} against transformers' {loss.get('hf_fp32_with_padding_logits')}: {common}"
    assert falls, f"losses at lr 1e-4: {learning}"
    assert exported, f"the lr-0 save's export: {export}"
