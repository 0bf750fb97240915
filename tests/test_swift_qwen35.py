"""mcore-to-hf on ms-swift's Qwen3.5 image-text saves, dense and MoE (tests/tool_saves.py lays them out as
mcore-bridge 1.6.5's bridge makes them: the language model under `language_model.` with its fused delta-net layers,
transformers' vision tower under `visual.visual.`): exported whole without --hf-config (args.json names the HF model),
every tensor equal to the original's and transformers' image-text class giving the original's logits on an
image-and-text prompt; a `language_model_only` save's vision tower copied from the HF model. Faults: the gated QKV
and the delta-net norm read as megatron-core's, a vision tensor missing, one outside the vision tower's module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mconvert.converters import swift_saves
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.errors import ConversionError
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import run_cli
from tests.test_tool_saves import END, IMAGE, START, assert_same_tensors, image_text_logits
from tests.tool_saves import hf_tensors, model_tensors, swift_qwen3_5_save, write_torch_dist

MODELS = {"dense": ("qwen3.5-0.8b", "Qwen3_5ForConditionalGeneration"), "moe": ("qwen3.5-35b-a3b", "Qwen3_5MoeForConditionalGeneration")}


MADE: dict = {}


def made(kind: str, tmp_path_factory):
    """A random-init Qwen3.5 image-text checkpoint (three delta-net layers, one of gated full attention, a vision tower
    of 2 blocks), mconvert's torch_dist of it at TP 2 and ms-swift's save of it, with its class name; made once."""
    if kind not in MADE:
        name, architecture = MODELS[kind]
        out = tmp_path_factory.mktemp(f"swift_{kind}")
        config = shrink(real_config(name), layers=4)
        config["vision_config"]["depth"] = 2
        config.update(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=START, vision_end_token_id=END)
        hf = make_hf_checkpoint(config, out / "hf", weight_std=0.1)
        convert_hf_to_mcore(hf, out / "mcore", parallelism=Parallelism(tp=2))
        MADE[kind] = hf, out / "mcore", swift_qwen3_5_save(hf, out / "mcore", out / "swift"), architecture
    return MADE[kind]


@pytest.fixture(scope="module", params=sorted(MODELS))
def swift(request, tmp_path_factory):
    return made(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return made("dense", tmp_path_factory)


def test_ms_swift_qwen3_5_save_exports_whole_without_hf_config(swift, tmp_path):
    hf, _, save, architecture = swift
    if architecture == MODELS["dense"][1]:  # the command line once; its printed notes are the export's
        out = run_cli("mcore-to-hf", "--load-dir", save, "--save-dir", tmp_path / "back")
        assert out.returncode == 0, out.stderr
        vision = len(hf_tensors(hf, "model.visual."))  # the summary counts every tensor written, the tower's too
        assert f"{len(hf_tensors(tmp_path / 'back'))} tensors ({vision} of them the save's vision tower)" in out.stdout
        notes = out.stdout
    else:
        notes = "\n".join(convert_mcore_to_hf(save, tmp_path / "back").notes)
    assert "read ms-swift's save" in notes and "args.json's model" in notes
    assert f"checked against transformers' {architecture}: every tensor it holds is written" in notes
    assert_same_tensors(hf, tmp_path / "back")
    assert torch.equal(image_text_logits(tmp_path / "back"), image_text_logits(hf))


@pytest.mark.parametrize("fault", ["qkv", "norm"])
def test_ms_swift_qwen3_5_layout_faults_move_the_tensors_they_concern(dense, tmp_path, monkeypatch, fault):
    """Read as megatron-core's, the gated QKV's rows (mcore-bridge's per-head order) move the full-attention layer's
    q_proj, the delta-net norm's w taken for w - 1 moves the three delta-net layers' norms; nothing else moves."""
    hf, _, save, _ = dense
    if fault == "qkv":
        monkeypatch.setattr(swift_saves, "gated_qkv_as_megatron_cores", lambda stored, spec: stored)
        moved = ["model.language_model.layers.3.self_attn.q_proj.weight"]
    else:
        monkeypatch.setattr(swift_saves, "OUT_NORM", "self_attention.out_norm.nothing")
        moved = [f"model.language_model.layers.{layer}.linear_attn.norm.weight" for layer in range(3)]
    convert_mcore_to_hf(save, tmp_path / "back")
    a, b = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(name for name in a if not torch.equal(a[name], b[name])) == moved


def rewritten(save, tmp_path, change):
    """A copy of ms-swift's save with its tensors changed by `change` (a dict of them, edited in place)."""
    copy = shutil.copytree(save, tmp_path / "swift")
    tensors = model_tensors(copy)
    change(tensors)
    shutil.rmtree(copy / "iter_0000002")
    write_torch_dist(tensors, copy / "iter_0000002", tracker="2")
    return copy


def test_a_missing_vision_tensor_and_one_outside_the_tower_are_named(dense, tmp_path):
    _, _, save, _ = dense
    missing = rewritten(save, tmp_path, lambda tensors: tensors.pop("visual.visual.blocks.1.attn.qkv.weight"))
    with pytest.raises(ConversionError, match=r"model\.visual\.blocks\.1\.attn\.qkv\.weight.*leave out|leave out.*model\.visual\.blocks\.1\.attn\.qkv\.weight"):
        convert_mcore_to_hf(missing, tmp_path / "back")
    assert not (tmp_path / "back").exists()
    shutil.rmtree(missing)
    outside = rewritten(save, tmp_path, lambda tensors: tensors.update({"visual.extra.weight": torch.zeros(4)}))
    with pytest.raises(ConversionError, match=r"'visual\.extra\.weight'.*visual\.visual\."):
        convert_mcore_to_hf(outside, tmp_path / "back")


def test_a_language_model_only_save_takes_the_vision_tower_from_the_hf_model(dense, tmp_path):
    """ms-swift's `language_model_only` run builds and saves no vision tower: the HF model args.json names gives it."""
    hf, mcore, _, _ = dense
    save = swift_qwen3_5_save(hf, mcore, tmp_path / "swift", vision=False)
    export = convert_mcore_to_hf(save, tmp_path / "back")
    assert export.copied == len(hf_tensors(hf, "model.visual.")) and not export.saved_beside
    assert_same_tensors(hf, tmp_path / "back")


def test_inspect_reads_the_save_as_stored_and_the_model_args_json_names(dense, capsys):
    from mconvert.cli import main

    hf, _, save, _ = dense
    capsys.readouterr()
    assert main(["inspect", "--json", str(save)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tool"] == "ms-swift" and report["family"] == "qwen3_5" and report["config_from"].startswith(str(hf))
    names = {tensor["name"] for tensor in report["tensors"]}
    assert "language_model.decoder.layers.0.self_attention.in_proj.weight" in names  # fused, as ms-swift stores it
    assert {name.removeprefix("visual.visual.") for name in names if name.startswith("visual.")} == {
        name.removeprefix("model.visual.") for name in hf_tensors(hf, "model.visual.")
    }
