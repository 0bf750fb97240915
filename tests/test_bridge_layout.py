"""hf-to-mcore --layout megatron-bridge: a Qwen3.5 image-text checkpoint written as Megatron-Bridge 0.6.2 saves its
vision-language model, at TP 2 and PP 2. Back through mcore-to-hf it gives every HF tensor bit for bit, vision tower
included, and transformers' image-text logits; the save holds the keys, shapes, records and QKV order Megatron-Bridge's
own code makes (tests/fixtures/tool_saves/MADE.md). Faults: the vision QKV written in HF's order, a vision tensor the
layout has no place for, a vision block missing, a model without a vision tower, the fsdp_dtensor format. Qwen3-VL
(its deepstack mergers stacked beside the blocks) the same way, from Megatron-Bridge's own model's fixture: faults, its
vision QKV in HF's order and its deepstack mergers swapped."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.converters import bridge_layout, bridge_saves
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import _load_common
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_one_line_error, run_cli
from tests.test_tool_saves import image_text_logits
from tests.tool_saves import hf_tensors, model_tensors, write_torch_dist

REPO = Path(__file__).resolve().parents[1]
IMAGE, START, END = 900, 902, 903
DEPTH = 2
QKV = [f"model.visual.blocks.{block}.attn.qkv.{kind}" for block in range(DEPTH) for kind in ("bias", "weight")]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """A random-init Qwen3.5 image-text checkpoint (4 layers, a vision tower of 2 blocks) and its conversion into
    Megatron-Bridge's layout at TP 2, PP 2."""
    out = tmp_path_factory.mktemp("qwen35")
    config = shrink(real_config("qwen3.5-0.8b"), layers=4)
    config["vision_config"]["depth"] = DEPTH
    config.update(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=START, vision_end_token_id=END)
    hf = make_hf_checkpoint(config, out / "hf", weight_std=0.1)
    result = to_bridge(hf, out / "mb")
    assert result.returncode == 0, result.stderr
    return hf, out / "mb", result.stdout


def to_bridge(hf, save_dir, *flags):
    return run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", save_dir, "--tp", "2", "--pp", "2", "--layout", "megatron-bridge", *flags)


def differing(original, exported) -> list[str]:
    a, b = hf_tensors(original), hf_tensors(exported)
    assert sorted(a) == sorted(b)
    return sorted(name for name in a if not torch.equal(a[name], b[name]))


def test_round_trip_through_megatron_bridges_layout_is_bit_exact_vision_included(qwen35, tmp_path):
    hf, save, stdout = qwen35
    assert "checkpoint.pretrained_checkpoint=" in stdout and "left out" not in stdout
    assert f"qwen3_5, {len(model_tensors(save))} tensors, " in stdout  # the summary counts the vision tower's too
    assert not (save / "megatron_args.sh").exists()  # Megatron-LM's records are not this layout's
    out = run_cli("mcore-to-hf", "--load-dir", save, "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert "read Megatron-Bridge's save" in out.stdout
    assert f"{len(hf_tensors(hf))} tensors (33 of them the save's vision tower)" in out.stdout  # every tensor written
    assert differing(hf, tmp_path / "back") == []
    assert torch.equal(image_text_logits(tmp_path / "back"), image_text_logits(hf))


def test_the_save_holds_megatron_bridges_keys_records_and_qkv_order(qwen35):
    hf, save, _ = qwen35
    release = save / "release"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "release"
    import yaml

    config = yaml.safe_load((release / "run_config.yaml").read_text())
    assert config["model"]["tensor_model_parallel_size"] == 2 and config["model"]["pipeline_model_parallel_size"] == 2
    assert config["model"]["hf_model_id"] == str(Path(hf).resolve())
    assert config["checkpoint"] == {"save_optim": False, "save_rng": False, "fully_parallel_save": True}
    common = _load_common(release / "common.pt")
    assert "args" not in common and common["content_metadata"] == bridge_layout.CONTENT_METADATA

    checkpoint = DCPCheckpoint(release)
    assert all(key.startswith(("language_model.", "vision_model.")) for key in checkpoint.shapes)
    assert all(key.startswith(("language_model.", "vision_model.")) for key in checkpoint.object_keys)
    original = hf_tensors(hf, "model.visual.")
    stored = model_tensors(save)
    qkv = stored["vision_model.decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == DEPTH  # the blocks stacked, as Megatron-Bridge's vision config leaves them
    heads = json.loads((Path(hf) / "config.json").read_text())["vision_config"]["num_heads"]
    for block in range(DEPTH):
        hf_qkv = original[f"model.visual.blocks.{block}.attn.qkv.weight"]
        assert torch.equal(qkv[block], torch.from_numpy(bridge_saves.interleave_qkv(hf_qkv.numpy(), heads)))
    assert torch.equal(stored["vision_model.pos_embed.weight"], original["model.visual.pos_embed.weight"])
    assert "vision_model.decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in checkpoint.object_keys
    # The language model: megatron-core's keys under language_model., one key a layer (its layers are not alike).
    assert "language_model.embedding.word_embeddings.weight" in stored
    assert "language_model.decoder.layers.3.self_attention.linear_qkv.weight" in stored


def test_the_writers_qkv_order_is_megatron_bridges_own():
    """Megatron-Bridge's own merge of a vision block's QKV (tests/fixtures/tool_saves/MADE.md) is what the layout
    writes from HF's rows."""
    fixture = load_file(REPO / "tests" / "fixtures" / "tool_saves" / "megatron_bridge_vision_qkv.safetensors")
    for kind in ("weight", "bias"):
        hf, megatron_bridge = fixture[f"hf.attn.qkv.{kind}"], fixture[f"megatron_bridge.linear_qkv.{kind}"]
        assert torch.equal(torch.from_numpy(bridge_saves.interleave_qkv(hf.numpy(), 2)), megatron_bridge)


def test_qkv_written_in_hfs_order_moves_exactly_the_qkv_tensors_back(qwen35, tmp_path, monkeypatch):
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
    from mconvert.mcore.parallelism import Parallelism

    hf = qwen35[0]
    monkeypatch.setattr(bridge_layout, "interleave_qkv", lambda fused, heads: fused)
    convert_hf_to_mcore(hf, tmp_path / "mb", parallelism=Parallelism(tp=2, pp=2), layout="megatron-bridge")
    convert_mcore_to_hf(tmp_path / "mb", tmp_path / "back")
    assert differing(hf, tmp_path / "back") == QKV


def with_vision_tensors(hf, into: Path, change) -> Path:
    """A copy of the HF checkpoint with its vision tensors changed by `change` (a dict, edited in place)."""
    shutil.copytree(hf, into)
    for path in into.glob("*.safetensors"):
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    (into / "model.safetensors.index.json").unlink(missing_ok=True)
    return into


def test_a_vision_tensor_the_layout_has_no_place_for_is_named_in_one_line(qwen35, tmp_path):
    hf = with_vision_tensors(qwen35[0], tmp_path / "hf", lambda t: t.update({"model.visual.blocks.0.attn.extra.weight": torch.zeros(4)}))
    failed = to_bridge(hf, tmp_path / "mb")
    assert_one_line_error(failed, "model.visual.blocks.0.attn.extra.weight")
    assert not (tmp_path / "mb").exists()


def test_a_missing_vision_block_is_named_in_one_line(qwen35, tmp_path):
    def drop_block_0(tensors):
        for name in [name for name in tensors if name.startswith("model.visual.blocks.0.")]:
            tensors[name.replace("blocks.0.", "blocks.2.")] = tensors.pop(name)

    failed = to_bridge(with_vision_tensors(qwen35[0], tmp_path / "hf", drop_block_0), tmp_path / "mb")
    assert_one_line_error(failed, "not numbered 0 to 1")


def test_a_model_without_vision_tower_and_the_fsdp_format_are_refused_in_one_line(qwen35, tmp_path):
    text = with_vision_tensors(qwen35[0], tmp_path / "hf", lambda t: [t.pop(n) for n in [n for n in t if n.startswith("model.visual.")]])
    assert_one_line_error(to_bridge(text, tmp_path / "mb"), "--layout megatron-bridge", "no vision tower")
    assert_one_line_error(to_bridge(qwen35[0], tmp_path / "mb", "--format", "fsdp_dtensor"), "--format fsdp_dtensor")


MADE_BY_BRIDGE = REPO / "tests" / "fixtures" / "megatron_bridge_qwen35_vl"
MOE_MADE_BY_BRIDGE = REPO / "tests" / "fixtures" / "megatron_bridge_qwen35_vl_moe"
QWEN3_VL_MADE_BY_BRIDGE = REPO / "tests" / "fixtures" / "megatron_bridge_qwen3_vl"


def stored_against_megatron_bridges_import(save: Path, made: Path = MADE_BY_BRIDGE) -> tuple[set[str], list[str]]:
    """The keys of the regions Megatron-Bridge's own import made of the fixture's HF checkpoint (its Qwen3VLModel on a
    CPU rank, scripts/fixtures/megatron_bridge_vl.py) compared with the save, and those that differ."""
    from mconvert.dtypes import as_torch

    checkpoint = DCPCheckpoint(save / "release")
    # Each region's shape and the SHA-256 of its fp32 bytes: bit for bit, without keeping the tensors.
    imported = json.loads((made / "megatron_bridge_import.json").read_text())
    differ = []
    for label, region in imported.items():
        key, at = label.split("@")
        offsets = tuple(int(number) for number in at.split(","))
        shape = tuple(region["shape"])
        stored = as_torch(checkpoint.read_region(key, offsets, (1,) * (len(offsets) - len(shape)) + shape)).float()
        if hashlib.sha256(stored.contiguous().numpy().tobytes()).hexdigest() != region["sha256"]:
            differ.append(key)
    return {label.split("@")[0] for label in imported}, sorted(differ)


@pytest.mark.parametrize("made", [MADE_BY_BRIDGE, MOE_MADE_BY_BRIDGE, QWEN3_VL_MADE_BY_BRIDGE], ids=["dense", "moe", "qwen3-vl"])
def test_the_save_is_what_megatron_bridges_own_model_and_import_make(made, tmp_path):
    """Its Qwen3VLModel's checkpoint keys and global shapes at TP 2 x PP 2, and every region its own HF import makes;
    the save's one other kind of key is the MoE layers' norm under Transformer Engine's name (written under both
    specs' names; the model here is built from megatron-core's local modules)."""
    save = tmp_path / "mb"
    assert to_bridge(made / "hf", save).returncode == 0
    keys = json.loads((made / "keys_tp2_pp2.json").read_text())
    stored = {key: list(shape) for key, shape in DCPCheckpoint(save / "release").shapes.items()}
    assert {key: stored.get(key) for key in keys} == keys
    assert all(key.endswith(".pre_mlp_layernorm.weight") for key in set(stored) - set(keys))
    compared, differ = stored_against_megatron_bridges_import(save, made)
    assert compared == set(keys) and differ == []


def test_qkv_in_hfs_order_or_a_padded_vocabulary_differ_from_megatron_bridges_import(tmp_path, monkeypatch):
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.parallelism import Parallelism

    monkeypatch.setattr(bridge_layout, "interleave_qkv", lambda fused, heads: fused)
    convert_hf_to_mcore(MADE_BY_BRIDGE / "hf", tmp_path / "qkv", parallelism=Parallelism(tp=2), layout="megatron-bridge")
    qkv = [f"vision_model.decoder.layers.self_attention.linear_qkv.{kind}" for kind in ("bias", "bias", "weight", "weight")]
    assert stored_against_megatron_bridges_import(tmp_path / "qkv")[1] == qkv
    # Megatron-LM's layout pads the vocabulary (to 128 x TP rows): not the shape Megatron-Bridge's model has.
    convert_hf_to_mcore(MADE_BY_BRIDGE / "hf", tmp_path / "lm", parallelism=Parallelism(tp=2))
    keys = json.loads((MADE_BY_BRIDGE / "keys_tp2_pp2.json").read_text())
    padded = DCPCheckpoint(tmp_path / "lm" / "release").shapes["embedding.word_embeddings.weight"]
    assert list(padded) != keys["language_model.embedding.word_embeddings.weight"]


DEEPSTACK = [f"model.visual.deepstack_merger_list.{merger}.{name}" for merger in range(2)
             for name in ("linear_fc1.bias", "linear_fc1.weight", "linear_fc2.bias", "linear_fc2.weight", "norm.bias", "norm.weight")]


def deepstack_swapped(monkeypatch) -> None:
    """The layout written with Qwen3-VL's two deepstack mergers in each other's place."""
    keys = bridge_layout.vision_keys
    monkeypatch.setattr(bridge_layout, "vision_keys", lambda names, prefix: {
        key: sources[::-1] if "deepstack_merger_list" in key else sources for key, sources in keys(names, prefix).items()})


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """Megatron-Bridge's Qwen3-VL fixture checkpoint (4 layers, 2 vision blocks each followed by a deepstack merger) in
    its layout at TP 2, PP 2."""
    save = tmp_path_factory.mktemp("qwen3_vl") / "mb"
    result = to_bridge(QWEN3_VL_MADE_BY_BRIDGE / "hf", save)
    assert result.returncode == 0, result.stderr
    assert "Megatron-Bridge (a recipe of its qwen3_vl vision-language model" in result.stdout
    # Each deepstack merger's TE modules' state, as each block's: by its place in the stack.
    assert "vision_model.decoder.deepstack_merger_list.linear_fc1._extra_state/shard_1_2" in DCPCheckpoint(save / "release").object_keys
    return save


def test_qwen3_vl_round_trip_is_bit_exact_and_whole_by_transformers_class(qwen3_vl, tmp_path):
    hf = QWEN3_VL_MADE_BY_BRIDGE / "hf"
    out = run_cli("mcore-to-hf", "--load-dir", qwen3_vl, "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert f"{len(hf_tensors(hf))} tensors (45 of them the save's vision tower)" in out.stdout  # every tensor written
    assert "checked against transformers' Qwen3VLForConditionalGeneration: every tensor it holds is written, and no other" in out.stdout
    assert differing(hf, tmp_path / "back") == []
    assert torch.equal(image_text_logits(tmp_path / "back"), image_text_logits(hf))


def test_qwen3_vl_save_with_its_vision_modules_keyed_one_by_one_exports_the_same(qwen3_vl, tmp_path):
    """Megatron-Bridge's heterogeneous checkpoints key each block and deepstack merger apart: read the same."""
    tensors = {}
    for key, tensor in model_tensors(qwen3_vl).items():
        stacked = bridge_saves.stacked_prefix(key)
        tensors.update({f"{stacked}{number}.{key.removeprefix(stacked)}": one for number, one in enumerate(tensor)} if stacked else {key: tensor})
    assert "vision_model.decoder.deepstack_merger_list.1.linear_fc1.weight" in tensors
    write_torch_dist(tensors, tmp_path / "mb" / "release")
    shutil.copy2(qwen3_vl / "release" / "run_config.yaml", tmp_path / "mb" / "release")
    from mconvert.converters.mcore_to_hf import convert_mcore_to_hf

    convert_mcore_to_hf(tmp_path / "mb", tmp_path / "back")
    assert differing(QWEN3_VL_MADE_BY_BRIDGE / "hf", tmp_path / "back") == []


def test_qwen3_vl_deepstack_mergers_swapped_move_exactly_them_back(tmp_path, monkeypatch):
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
    from mconvert.mcore.parallelism import Parallelism

    deepstack_swapped(monkeypatch)
    convert_hf_to_mcore(QWEN3_VL_MADE_BY_BRIDGE / "hf", tmp_path / "mb", parallelism=Parallelism(tp=2, pp=2), layout="megatron-bridge")
    convert_mcore_to_hf(tmp_path / "mb", tmp_path / "back")
    assert differing(QWEN3_VL_MADE_BY_BRIDGE / "hf", tmp_path / "back") == DEEPSTACK


@pytest.mark.parametrize("fault", ["qkv-in-hf-order", "deepstack-swapped"])
def test_qwen3_vl_faults_differ_from_megatron_bridges_import_in_exactly_their_tensors(fault, tmp_path, monkeypatch):
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.parallelism import Parallelism

    if fault == "qkv-in-hf-order":
        monkeypatch.setattr(bridge_layout, "interleave_qkv", lambda fused, heads: fused)
        changed = [f"vision_model.decoder.layers.self_attention.linear_qkv.{kind}" for kind in ("bias", "weight")]
    else:
        deepstack_swapped(monkeypatch)
        changed = [f"vision_model.decoder.deepstack_merger_list.{name}" for name in
                   ("linear_fc1.bias", "linear_fc1.weight", "linear_fc2.bias", "linear_fc2.weight", "patch_norm.bias", "patch_norm.weight")]
    convert_hf_to_mcore(QWEN3_VL_MADE_BY_BRIDGE / "hf", tmp_path / "mb", parallelism=Parallelism(tp=2), layout="megatron-bridge")
    differ = stored_against_megatron_bridges_import(tmp_path / "mb", QWEN3_VL_MADE_BY_BRIDGE)[1]
    assert differ == sorted(key for key in changed for _ in range(2))  # each key's two regions: its two blocks or mergers
