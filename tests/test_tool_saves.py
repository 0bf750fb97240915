"""mcore-to-hf on the saves other tools write, recognised from what their folders hold (tests/tool_saves.py lays them
out as each tool's save code does): Megatron-Bridge's Qwen3.5 vision-language save exported whole, vision tower
included, without --hf-config (its run_config.yaml names the HF model), every tensor equal to the original's and
transformers' image-text class giving the original's logits on an image-and-text prompt; verl's, NeMo-RL's and
slime's run folders taken from their top folder; a Megatron-LM save without args asking for --hf-config in one line.
Faults: the vision QKV read in the wrong order, a vision tensor missing, one unknown, a record naming no model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from mconvert.converters import bridge_saves
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_one_line_error, run_cli
from tests.tool_saves import (
    bridge_vision_language_save,
    copy_hf_config,
    hf_tensors,
    model_tensors,
    swift_qwen3_next_save,
    with_args,
    without_args,
    write_torch_dist,
)

REPO = Path(__file__).resolve().parents[1]
IMAGE, START, END = 900, 902, 903
GRID = torch.tensor([[1, 4, 4]])  # 16 patches, merged 2 x 2 into 4 image tokens


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """A random-init Qwen3.5 image-text checkpoint (4 layers, a vision tower of 2 blocks, its image tokens inside the
    shrunk vocabulary) and mconvert's torch_dist of it at TP 2."""
    out = tmp_path_factory.mktemp("qwen35")
    config = shrink(real_config("qwen3.5-0.8b"), layers=4)
    config["vision_config"]["depth"] = 2
    config.update(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=START, vision_end_token_id=END)
    hf = make_hf_checkpoint(config, out / "hf", weight_std=0.1)
    convert_hf_to_mcore(hf, out / "mcore", parallelism=Parallelism(tp=2))
    return hf, out / "mcore"


def image_text_logits(hf_dir) -> torch.Tensor:
    """transformers' image-text class (Qwen3.5's, Qwen3-VL's) on a prompt of 150 tokens with an image of 16 patches in it."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 800, (1, 150), generator=generator)
    ids[0, 10], ids[0, 11:15], ids[0, 15] = START, IMAGE, END
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=generator)
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=GRID, mm_token_type_ids=(ids == IMAGE).long()).logits


def bridge_run(qwen35, tmp_path, **options):
    hf, mcore = qwen35
    shutil.copytree(hf, tmp_path / "run" / "hf")
    return bridge_vision_language_save(hf, mcore, tmp_path / "run", **options)


def assert_same_tensors(original, exported) -> None:
    a, b = hf_tensors(original), hf_tensors(exported)
    assert sorted(a) == sorted(b)
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


@pytest.mark.parametrize("stacked", [False, True], ids=["blocks-keyed-one-by-one", "blocks-stacked"])
def test_megatron_bridge_vision_language_save_exports_whole_without_hf_config(qwen35, tmp_path, stacked):
    run = bridge_run(qwen35, tmp_path, vision_stacked=stacked)
    out = run_cli("mcore-to-hf", "--load-dir", run, "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert f"{len(hf_tensors(qwen35[0]))} tensors (33 of them the save's vision tower)" in out.stdout
    assert "read Megatron-Bridge's save" in out.stdout and "run_config.yaml's model.hf_model_id" in out.stdout
    assert "checked against transformers' Qwen3_5ForConditionalGeneration: every tensor it holds is written" in out.stdout
    assert_same_tensors(qwen35[0], tmp_path / "back")
    expected = image_text_logits(qwen35[0])
    assert torch.equal(image_text_logits(tmp_path / "back"), expected)


def test_vision_qkv_read_in_the_stored_order_moves_the_tensors_and_the_logits(qwen35, tmp_path, monkeypatch):
    run = bridge_run(qwen35, tmp_path)
    monkeypatch.setattr(bridge_saves, "deinterleave_qkv", lambda fused, heads: fused)
    convert_mcore_to_hf(run, tmp_path / "back")
    a, b = hf_tensors(qwen35[0]), hf_tensors(tmp_path / "back")
    assert sorted(name for name in a if not torch.equal(a[name], b[name])) == [
        f"model.visual.blocks.{block}.attn.qkv.{kind}" for block in (0, 1) for kind in ("bias", "weight")
    ]
    assert (image_text_logits(tmp_path / "back") - image_text_logits(qwen35[0])).abs().max() > 1e-3


def test_a_missing_vision_tensor_is_named_in_one_line(qwen35, tmp_path):
    run = bridge_run(qwen35, tmp_path)
    directory = run / "iter_0000005"
    tensors = model_tensors(run)
    del tensors["vision_model.decoder.layers.1.self_attention.linear_qkv.weight"]
    shutil.rmtree(directory)
    write_torch_dist(tensors, directory, tracker="5")
    shutil.copy2(_run_config(tmp_path), directory / "run_config.yaml")
    failed = run_cli("mcore-to-hf", "--load-dir", run, "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, "model.visual.blocks.1.attn.qkv.weight", "leave out")
    assert not (tmp_path / "back").exists()


def _run_config(tmp_path):
    """A run_config.yaml naming the run's HF model, for a save rewritten with a fault."""
    path = tmp_path / "run_config.yaml"
    path.write_text(f"model:\n  hf_model_id: {tmp_path / 'run' / 'hf'}\n")
    return path


def test_an_unknown_vision_tensor_is_named_in_one_line(qwen35, tmp_path):
    run = bridge_run(qwen35, tmp_path)
    tensors = model_tensors(run)
    tensors["vision_model.decoder.layers.0.self_attention.extra.weight"] = torch.zeros(4)
    shutil.rmtree(run / "iter_0000005")
    write_torch_dist(tensors, run / "iter_0000005", tracker="5")
    shutil.copy2(_run_config(tmp_path), run / "iter_0000005" / "run_config.yaml")
    failed = run_cli("mcore-to-hf", "--load-dir", run, "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, "vision_model.decoder.layers.0.self_attention.extra.weight")


def test_a_run_config_naming_no_model_asks_for_hf_config_and_one_naming_a_missing_folder_says_which(qwen35, tmp_path):
    run = bridge_run(qwen35, tmp_path, hf_model_id=None)
    failed = run_cli("mcore-to-hf", "--load-dir", run, "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, "--hf-config")
    out = run_cli("mcore-to-hf", "--load-dir", run, "--save-dir", tmp_path / "back", "--hf-config", run / "hf")
    assert out.returncode == 0, out.stderr
    assert_same_tensors(qwen35[0], tmp_path / "back")
    (run / "iter_0000005" / "run_config.yaml").write_text("model:\n  hf_model_id: /nowhere/Qwen3.5-tiny\n")
    failed = run_cli("mcore-to-hf", "--load-dir", run, "--save-dir", tmp_path / "back2")
    assert_one_line_error(failed, "/nowhere/Qwen3.5-tiny", "model.hf_model_id", "--hf-config")


def test_verl_run_folder_with_a_megatron_bridge_back_end_is_found_from_its_top_folder(qwen35, tmp_path):
    """verl's Megatron checkpoint manager: global_step_<N>/actor/dist_ckpt (the model's sharded state dict, here
    Megatron-Bridge's Qwen3.5), huggingface/ (config and tokenizer), the step in the top folder's tracker file."""
    hf, _ = qwen35
    top = tmp_path / "ckpts"
    tensors = model_tensors(bridge_run(qwen35, tmp_path))
    for step in (10, 20):
        write_torch_dist(tensors, top / f"global_step_{step}" / "actor" / "dist_ckpt", tracker=None)
        copy_hf_config(hf, top / f"global_step_{step}" / "actor" / "huggingface")
    (top / "latest_checkpointed_iteration.txt").write_text("10")
    shutil.rmtree(top / "global_step_20" / "actor" / "dist_ckpt")  # the tracker names step 10, which is read
    out = run_cli("mcore-to-hf", "--load-dir", top, "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert f"read verl's save in {top / 'global_step_10' / 'actor' / 'dist_ckpt'}" in out.stdout
    assert_same_tensors(hf, tmp_path / "back")
    failed = run_cli("mcore-to-hf", "--load-dir", top, "--iteration", "30", "--save-dir", tmp_path / "back2")
    assert_one_line_error(failed, "--iteration 30", "global_step_30")
    shutil.copytree(hf, top / "global_step_20" / "actor" / "huggingface", dirs_exist_ok=True)  # verl's HF-weights save
    failed = run_cli("mcore-to-hf", "--load-dir", top, "--iteration", "20", "--save-dir", tmp_path / "back2")
    assert_one_line_error(failed, "HF weights", str(top / "global_step_20" / "actor" / "huggingface"))


def test_nemo_rl_run_folder_is_found_and_its_config_yaml_names_the_model(qwen35, tmp_path):
    """NeMo-RL: step_<N>/policy/weights/ a Megatron-Bridge save (iter_0000000), step_<N>/config.yaml beside."""
    hf, _ = qwen35
    bridge = bridge_run(qwen35, tmp_path, hf_model_id=None, iteration=0)
    top = tmp_path / "results"
    shutil.copytree(bridge, top / "step_3" / "policy" / "weights", ignore=shutil.ignore_patterns("hf"))
    (top / "step_3" / "config.yaml").write_text(f"policy:\n  model_name: {hf}\n")
    out = run_cli("mcore-to-hf", "--load-dir", top, "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert "read NeMo-RL's save" in out.stdout and "config.yaml's policy.model_name" in out.stdout
    assert_same_tensors(hf, tmp_path / "back")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3")
    hf = make_hf_checkpoint(shrink(real_config("qwen3-8b"), layers=2), out / "hf", weight_std=0.1)
    return hf, out


def test_megatron_lm_save_without_args_asks_for_hf_config_and_slimes_args_name_it(qwen3, tmp_path):
    hf, _ = qwen3
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    with_args(tmp_path / "mcore", hf_checkpoint=str(hf))  # slime stores its --hf-checkpoint among Megatron-LM's args
    out = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert "the checkpoint's args' hf_checkpoint (slime)" in out.stdout
    assert_same_tensors(hf, tmp_path / "back")
    without_args(tmp_path / "mcore")
    failed = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back2")
    assert_one_line_error(failed, "--hf-config")
    out = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back2", "--hf-config", hf)
    assert out.returncode == 0, out.stderr
    assert_same_tensors(hf, tmp_path / "back2")
    assert json.loads((tmp_path / "back2" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A random-init Qwen3-Next (three delta-net layers, one of gated full attention), mconvert's torch_dist of it
    at TP 2, and ms-swift's save of it."""
    out = tmp_path_factory.mktemp("qwen3_next")
    hf = make_hf_checkpoint(shrink(real_config("qwen3-next-80b-a3b-instruct"), layers=4), out / "hf", weight_std=0.1)
    convert_hf_to_mcore(hf, out / "mcore", parallelism=Parallelism(tp=2))
    return hf, out / "mcore", swift_qwen3_next_save(hf, out / "mcore", out / "swift")


def causal_logits(hf_dir) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.randint(0, 1000, (1, 160), generator=torch.Generator().manual_seed(0))).logits


def test_ms_swift_qwen3_next_save_exports_bit_exact_without_hf_config(qwen3_next, tmp_path):
    hf, _, swift = qwen3_next
    out = run_cli("mcore-to-hf", "--load-dir", swift, "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert "read ms-swift's save" in out.stdout and "args.json's model" in out.stdout
    assert_same_tensors(hf, tmp_path / "back")
    assert torch.equal(causal_logits(tmp_path / "back"), causal_logits(hf))


@pytest.mark.parametrize("fault, moved", [
    ("qkv", ["model.layers.3.self_attn.q_proj.weight"]),
    ("norm", [f"model.layers.{layer}.linear_attn.norm.weight" for layer in range(3)]),
])
def test_ms_swift_layout_faults_move_the_tensors_they_concern(qwen3_next, tmp_path, monkeypatch, fault, moved):
    """Each difference of ms-swift's layout read as megatron-core's moves the tensors it concerns: the gated QKV's
    rows left in mcore-bridge's order, the norm's w taken for megatron-core's w - 1."""
    from mconvert.converters import swift_saves

    hf, _, swift = qwen3_next
    if fault == "qkv":
        monkeypatch.setattr(swift_saves, "gated_qkv_as_megatron_cores", lambda stored, spec: stored)
    elif fault == "norm":
        monkeypatch.setattr(swift_saves, "OUT_NORM", "self_attention.out_norm.nothing")
    convert_mcore_to_hf(swift, tmp_path / "back")
    a, b = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(name for name in a if not torch.equal(a[name], b[name])) == sorted(moved)


def rewritten(save, change) -> None:
    """ms-swift's save with its tensors changed by `change` (a dict of them, edited in place)."""
    tensors = model_tensors(save)
    change(tensors)
    directory = save / "iter_0000002"
    shutil.rmtree(directory)
    write_torch_dist(tensors, directory, tracker="2")


def test_a_fused_in_proj_in_megatron_cores_section_order_moves_the_projections(qwen3_next, tmp_path):
    """The fused in_proj laid out as megatron-core's GatedDeltaNet holds it on one TP rank (every key head's q rows,
    then every head's k rows, ..., not per key head): read as ms-swift's, the input projections move, nothing else."""
    hf, _, swift = qwen3_next
    shutil.copytree(swift, tmp_path / "swift")
    sizes = [16, 16, 48, 48, 2, 2]  # one key head's q, k, v, z, b, a rows (the shrunk Qwen3-Next's 2 key heads)

    def section_order(tensors):
        for key in [key for key in tensors if key.endswith("self_attention.in_proj.weight")]:
            heads = [torch.split(head, sizes) for head in tensors[key].reshape(2, -1, 64)]
            tensors[key] = torch.cat([heads[head][section] for section in range(6) for head in range(2)])

    rewritten(tmp_path / "swift", section_order)
    convert_mcore_to_hf(tmp_path / "swift", tmp_path / "back")
    a, b = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(name for name in a if not torch.equal(a[name], b[name])) == [
        f"model.layers.{layer}.linear_attn.{name}.weight" for layer in range(3) for name in ("in_proj_ba", "in_proj_qkvz")
    ]


def test_a_missing_or_cut_fused_tensor_is_named_in_one_line(qwen3_next, tmp_path):
    _, _, swift = qwen3_next
    shutil.copytree(swift, tmp_path / "missing")
    rewritten(tmp_path / "missing", lambda tensors: tensors.pop("decoder.layers.1.self_attention.conv1d.weight"))
    failed = run_cli("mcore-to-hf", "--load-dir", tmp_path / "missing", "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, "decoder.layers.1.self_attention.conv1d.weight.query", "missing")
    shutil.copytree(swift, tmp_path / "cut")
    key = "decoder.layers.2.self_attention.in_proj.weight"
    rewritten(tmp_path / "cut", lambda tensors: tensors.update({key: tensors[key][:-4]}))
    failed = run_cli("mcore-to-hf", "--load-dir", tmp_path / "cut", "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, key, "260 rows", "264")


def test_the_vision_qkv_layout_is_megatron_bridges_own(tmp_path):
    """Megatron-Bridge's own QKV merge of a vision block (tests/fixtures/tool_saves/MADE.md) is what the tests' saves
    hold and what the export takes back to HF's rows."""
    from safetensors.torch import load_file

    from tests.tool_saves import interleave_qkv

    stored = load_file(REPO / "tests" / "fixtures" / "tool_saves" / "megatron_bridge_vision_qkv.safetensors")
    for kind in ("weight", "bias"):
        hf, megatron_bridge = stored[f"hf.attn.qkv.{kind}"], stored[f"megatron_bridge.linear_qkv.{kind}"]
        assert not torch.equal(hf, megatron_bridge)
        assert torch.equal(interleave_qkv(hf, 2), megatron_bridge)
        assert torch.equal(torch.from_numpy(bridge_saves.deinterleave_qkv(megatron_bridge.numpy(), 2)), hf)


def test_an_ms_swift_save_in_megatron_cores_own_keys_is_read_as_it_is(qwen3_next, tmp_path):
    """ms-swift's args.json beside a Qwen3-Next save without the fused keys (megatron-core's layout, the norm w - 1):
    no section, norm or QKV order of mcore-bridge's is applied."""
    hf, mcore, _ = qwen3_next
    shutil.copytree(mcore, tmp_path / "swift")
    (tmp_path / "swift" / "args.json").write_text(json.dumps({"model": str(hf)}))
    out = run_cli("mcore-to-hf", "--load-dir", tmp_path / "swift", "--save-dir", tmp_path / "back")
    assert out.returncode == 0, out.stderr
    assert_same_tensors(hf, tmp_path / "back")
