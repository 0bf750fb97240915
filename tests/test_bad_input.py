"""Bad input to hf-to-mcore: a one-line error naming the file, tensor or flag, exit 1, and nothing written
that Megatron could take for a checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mconvert.cli import main


@pytest.fixture
def hf(hf_model_factory, tmp_path):
    """A private copy of a tiny Qwen2.5 checkpoint, for a test to break."""
    copy = tmp_path / "hf"
    shutil.copytree(hf_model_factory("qwen2.5-7b-instruct"), copy)
    return copy


def convert(capsys, hf, out, *flags):
    code = main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(out), *flags])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_failed_cleanly(code, err, out, *names):
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("mconvert: error: ")
    for name in names:
        assert name in err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def rewrite_weights(hf, change):
    tensors = load_file(hf / "model.safetensors")
    change(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def test_truncated_shard(hf, tmp_path, capsys):
    path = hf / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out"), tmp_path / "out", "model.safetensors", "truncated")


def test_missing_shard(hf, tmp_path, capsys):
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, hf / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors" for i, n in enumerate(names)}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out"), tmp_path / "out", "model-00002-of-00002.safetensors", "missing")


def test_missing_tensor(hf, tmp_path, capsys):
    rewrite_weights(hf, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out"), tmp_path / "out", "model.layers.1.self_attn.k_proj.bias")


def test_extra_tensor(hf, tmp_path, capsys):
    rewrite_weights(hf, lambda t: t.update({"model.layers.0.mlp.extra.weight": t["model.norm.weight"].clone()}))
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out"), tmp_path / "out", "model.layers.0.mlp.extra.weight", "model.safetensors")


def test_shape_contradicts_config(hf, tmp_path, capsys):
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] = 96
    (hf / "config.json").write_text(json.dumps(config))
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out"), tmp_path / "out", "gate_proj.weight", "config.json implies [96, 64]")


def test_unknown_architecture(hf, tmp_path, capsys):
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "gpt2"
    (hf / "config.json").write_text(json.dumps(config))
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out"), tmp_path / "out", "config.json", "gpt2")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tp", "3"], "--tp 3"),  # 4 heads, 2 query groups (--tp 4, a multiple of them, megatron-core takes)
        (["--pp", "3"], "--pp 3 does not divide num_hidden_layers (2): split the layers unevenly"),  # 2 layers
        (["--pp", "2", "--decoder-first-pipeline-num-layers", "3"], "take 3 layers, the model has 2"),
        (["--pp", "2", "--decoder-last-pipeline-num-layers", "0"], "--decoder-last-pipeline-num-layers 0: must be at least 1"),
        (["--pp", "2", "--account-for-embedding-in-pipeline-split"], "with the embedding and loss counted as layers"),
        (["--pp", "2", "--pipeline-model-parallel-layout", "Et|t"], "the loss (L) last"),
        (["--pp", "2", "--pipeline-model-parallel-layout", "Et|tL|L"], "3 stages, not a multiple of --pp 2"),
        (["--pp", "2", "--pipeline-model-parallel-layout", "Et|ttL"], "3 decoder layers (t), the model has 2"),
        (["--pp", "2", "--pipeline-model-parallel-layout", "Et|tL", "--decoder-first-pipeline-num-layers", "1"], "not with the other"),
        (["--ep", "2"], "--ep"),  # dense model
        (["--model-size", "qwen3"], "--model-size"),
        (["--model-size", "gpt-j"], "--model-size"),
    ],
)
def test_bad_flags(hf, tmp_path, capsys, flags, named):
    assert_failed_cleanly(*convert(capsys, hf, tmp_path / "out", *flags), tmp_path / "out", named)


def test_existing_output_needs_overwrite(hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    code, err = convert(capsys, hf, out)
    assert code == 1 and "--overwrite" in err and (out / "keep").exists()
    code, _ = convert(capsys, hf, out, "--overwrite")
    assert code == 0 and not (out / "keep").exists()
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
