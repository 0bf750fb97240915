"""Bad input to mcore-to-hf: a one-line error naming what is wrong, exit 1, and no --save-dir written."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.mcore.checkpoint import RELEASE, TRACKER_FILE, read_args, write_common


@pytest.fixture(scope="module")
def checkpoint(hf_model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    convert_hf_to_mcore(hf_model_factory("qwen2.5-7b-instruct"), out)
    return out


@pytest.fixture
def private_checkpoint(checkpoint, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    return copy


def export_fails(capsys, load_dir, out, *flags):
    code = main(["mcore-to-hf", "--load-dir", str(load_dir), "--save-dir", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("mconvert: error: "), err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return err


def rewrite_args(checkpoint, **changes):
    release = checkpoint / RELEASE
    args = read_args(release)
    write_common(release, argparse.Namespace(**{**vars(args), **changes}))


def test_a_directory_that_is_not_a_checkpoint(hf_model_factory, tmp_path, capsys):
    hf = hf_model_factory("qwen3-8b")
    capsys.readouterr()  # what making the model printed
    err = export_fails(capsys, hf, tmp_path / "out")
    assert "not a Megatron checkpoint" in err
    err = export_fails(capsys, tmp_path / "nowhere", tmp_path / "out")
    assert "not a directory" in err


def test_an_iteration_that_does_not_exist(checkpoint, tmp_path, capsys):
    err = export_fails(capsys, checkpoint, tmp_path / "out", "--iteration", "7")
    assert "iter_0000007" in err and "release" in err


def test_a_tracker_naming_a_missing_iteration(private_checkpoint, tmp_path, capsys):
    (private_checkpoint / TRACKER_FILE).write_text("300")
    assert "iter_0000300" in export_fails(capsys, private_checkpoint, tmp_path / "out")


def test_args_that_contradict_the_tensors(private_checkpoint, tmp_path, capsys):
    rewrite_args(private_checkpoint, ffn_hidden_size=96)
    err = export_fails(capsys, private_checkpoint, tmp_path / "out")
    assert "linear_fc1.weight" in err and "[2, 192, 64]" in err


def test_an_architecture_no_family_has(private_checkpoint, tmp_path, capsys):
    rewrite_args(private_checkpoint, normalization="LayerNorm")
    assert "LayerNorm" in export_fails(capsys, private_checkpoint, tmp_path / "out")


def test_a_reference_config_of_another_model(checkpoint, hf_model_factory, tmp_path, capsys):
    reference = hf_model_factory("qwen3-8b")
    capsys.readouterr()  # what making the model printed
    err = export_fails(capsys, checkpoint, tmp_path / "out", "--hf-config", str(reference))
    assert "--hf-config says" in err


def test_no_args_and_no_reference(private_checkpoint, tmp_path, capsys):
    torch.save({}, private_checkpoint / RELEASE / "common.pt")
    assert "--hf-config" in export_fails(capsys, private_checkpoint, tmp_path / "out")


def test_a_bad_shard_size(checkpoint, tmp_path, capsys):
    assert "5 parsecs" in export_fails(capsys, checkpoint, tmp_path / "out", "--max-shard-size", "5 parsecs")


def test_a_model_size_naming_another_family(checkpoint, tmp_path, capsys):
    err = export_fails(capsys, checkpoint, tmp_path / "out", "--model-size", "qwen3-moe")
    assert "--model-size 'qwen3-moe' names family 'qwen3_moe'" in err and "a qwen2 model" in err
    assert main(["mcore-to-hf", "--load-dir", str(checkpoint), "--save-dir", str(tmp_path / "ok"), "--model-size", "qwen2.5-7B"]) == 0
