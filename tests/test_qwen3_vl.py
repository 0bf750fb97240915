"""Qwen3-VL in Megatron-LM's layout: the language model (Qwen3 under `model.language_model.`) converted at TP 2, its
vision tower left out and said so; megatron-core's GPTModel gives transformers' Qwen3VLForConditionalGeneration's
logits on text (`mconvert verify`, CPU ranks); mcore-to-hf with --hf-config writes the image-text checkpoint back bit
for bit, vision tower copied. Megatron-Bridge's layout, vision tower included: tests/test_bridge_layout.py."""

from __future__ import annotations

from pathlib import Path

import torch

from mconvert.cli import main
from tests.tool_saves import hf_tensors

HF = Path(__file__).resolve().parent / "fixtures" / "megatron_bridge_qwen3_vl" / "hf"


def test_qwen3_vl_language_model_converts_verifies_and_comes_back_with_its_vision_tower(tmp_path, capsys):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--load-dir", str(HF), "--save-dir", str(mcore), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "left out the vision tower" in out and "45 tensors" in out and "--qk-layernorm" in out
    assert main(["verify", "--hf", str(HF), "--mcore", str(mcore), "--device", "cpu", "--tp", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")
    assert main(["mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back), "--hf-config", str(HF)]) == 0
    assert "checked against transformers' Qwen3VLForConditionalGeneration" in capsys.readouterr().out
    original, exported = hf_tensors(HF), hf_tensors(back)
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
