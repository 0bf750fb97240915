"""Megatron-LM's FSDP formats: `hf-to-mcore --format fsdp_dtensor` (what a Megatron-FSDP run loads) and the way
back from fsdp_dtensor and torch_dcp saves. The names are judged here against Megatron-LM's own saves: DCP folders
written by torch's `dcp.save` of a state dict nested as Megatron-LM nests it; Megatron-LM's real saves, made on a
GPU, are held in tests/fixtures/fsdp (tests/test_fsdp_fixtures.py)."""

from __future__ import annotations

import argparse
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from safetensors.torch import load_file

from mconvert.converters.fsdp_saves import FsdpCheckpoint
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import TRACKER_FILE

# id: (real config, overrides, mconvert flags)
CASES = {
    "llama-tp2": ("llama-3.1-8b", {}, ["--tp", "2"]),
    "qwen2.5-tied": ("qwen2.5-7b-instruct", {"tie_word_embeddings": True}, []),
    "qwen3-moe-ep2": ("qwen3-30b-a3b", {}, ["--ep", "2"]),
    # Multi-latent attention, a dense then an MoE layer with a shared expert and the routing bias, an MTP layer.
    "deepseek-v3-mtp": ("deepseek-v3", {"mtp": True}, []),
}


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def make(hf_model_factory, case):
    config, overrides, flags = CASES[case]
    return hf_model_factory(config, **overrides), flags


@pytest.mark.parametrize("case", CASES)
def test_fsdp_dtensor_round_trip_is_bit_exact(case, hf_model_factory, tmp_path):
    hf, flags = make(hf_model_factory, case)
    out, back = tmp_path / "fsdp", tmp_path / "back"
    done = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, "--format", "fsdp_dtensor", "--quiet", *flags)
    assert done.returncode == 0, done.stderr
    # Iteration 0 of a run, not a release (Megatron-FSDP starts from it only as a resumption: test_the_flags...).
    first = out / "iter_0000000"
    assert (out / TRACKER_FILE).read_text() == "0"
    # What tells Megatron-LM an FSDP save from torch_dist: a DCP folder without metadata.json.
    assert (first / ".metadata").exists() and not (first / "metadata.json").exists()
    stored = DCPCheckpoint(first)
    assert set(stored.object_keys) == {"args", "checkpoint_version", "iteration"}
    assert stored.read_object("args").ckpt_format == "fsdp_dtensor"
    # SwiGLU fc1 in halves only, never whole.
    assert [k for k in stored.shapes if re.search(r"\.linear_fc1\.weight\d*_w$", k)]
    assert not [k for k in stored.shapes if re.search(r"\.linear_fc1\.weight\d*$", k)]
    done = run_cli("mcore-to-hf", "--load-dir", out, "--save-dir", back, "--hf-config", hf, "--quiet")
    assert done.returncode == 0, done.stderr
    original, exported = hf_tensors(hf), hf_tensors(back)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    shown = run_cli("inspect", out)
    assert shown.returncode == 0 and "fsdp_dtensor checkpoint" in shown.stdout, shown.stdout + shown.stderr


def test_the_flags_start_a_megatron_fsdp_run(hf_model_factory, tmp_path):
    hf, _ = make(hf_model_factory, "llama-tp2")
    out = tmp_path / "fsdp"
    assert run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, "--format", "fsdp_dtensor", "--tp", "2").returncode == 0
    script = (out / "megatron_args.sh").read_text()
    load = script[script.index("LOAD_ARGS=(") :].split()
    # Not --finetune nor --no-load-optim: with either, Megatron-LM 0.19.2 copies the loaded weights into
    # Megatron-FSDP's main parameters, which it does not implement (NotImplementedError, measured on a GPU).
    assert load[1:] == ["--load", str(out.absolute()), "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--no-load-rng", ")"]
    assert "--tensor-model-parallel-size 2" in script
    train = (out / "train.sh").read_text()
    assert 'LOAD_ARGS=(--load "$CHECKPOINT_DIR" --use-megatron-fsdp --ckpt-format fsdp_dtensor --no-load-rng)' in train


def test_pipeline_stages_are_refused_for_fsdp_dtensor(hf_model_factory, tmp_path):
    hf, _ = make(hf_model_factory, "llama-tp2")
    out = tmp_path / "fsdp"
    done = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, "--format", "fsdp_dtensor", "--pp", "2")
    assert_one_line_error(done, "--format fsdp_dtensor", "--pp 2")
    assert_nothing_left(out)


def megatron_lm_save(directory, model: dict[str, torch.Tensor], prefix: str, **args) -> None:
    """A save as Megatron-LM writes one with a FSDP wrapper: `dcp.save` of its state dict, nested as its
    generate_state_dict nests it, `prefix` the wrapper's level ("module." under Megatron-FSDP)."""
    state = {
        "args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": 7,
        "model": {prefix + name: tensor for name, tensor in model.items()},
        "optimizer": {"state": {"0": {"exp_avg": torch.full((3,), float("nan"))}}},
    }
    directory.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def test_the_way_back_reads_the_names_as_megatron_lm_nests_them(tmp_path):
    """Halves joined as gate then up, experts by their global number, the MTP layer's module name, each format's
    prefix; the optimizer's state left unread."""
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    model = {
        "decoder.layers.0.mlp.linear_fc1.weight_w": gate, "decoder.layers.0.mlp.linear_fc1.weight_v": up,
        "decoder.layers.1.mlp.experts.linear_fc2.weight5": torch.randn(3, 2),
        "mtp.layers.0.mtp_model_layer.input_layernorm.weight": torch.randn(3),
        "embedding.word_embeddings.weight": torch.randn(8, 3),
    }
    megatron_lm_save(tmp_path / "fsdp", model, "module.", pipeline_model_parallel_size=1)
    save = FsdpCheckpoint(tmp_path / "fsdp")
    assert save.format == "fsdp_dtensor" and save.args.pipeline_model_parallel_size == 1
    assert save.entries[("mlp.linear_fc1.weight", 0, None)] == (
        "model.module.decoder.layers.0.mlp.linear_fc1.weight_w", "model.module.decoder.layers.0.mlp.linear_fc1.weight_v")
    assert ("mlp.experts.experts.linear_fc2.weight", 1, 5) in save.entries
    assert ("mtp.layers.0.transformer_layer.input_layernorm.weight", None, None) in save.entries
    megatron_lm_save(tmp_path / "dcp", {"decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate, up])}, "")
    assert FsdpCheckpoint(tmp_path / "dcp").format == "torch_dcp"


@pytest.mark.parametrize("model, args, expected", [
    ({"decoder.layers.0.mlp.linear_fc1.weight_w": torch.ones(2, 2)}, {}, "has its gate half alone"),
    ({"decoder.layers.0.mlp.linear_fc2.weight": torch.ones(2, 2)}, {"pipeline_model_parallel_size": 2}, "2 pipeline stages"),
    ({}, {}, "without model weights"),
])
def test_saves_the_way_back_cannot_read_end_in_one_line(model, args, expected, tmp_path):
    megatron_lm_save(tmp_path / "save" / "iter_0000007", model, "module.", **args)
    (tmp_path / "save" / TRACKER_FILE).write_text("7")
    done = run_cli("mcore-to-hf", "--load-dir", tmp_path / "save", "--save-dir", tmp_path / "out")
    assert_one_line_error(done, "iter_0000007", expected)
    assert_nothing_left(tmp_path / "out")


def test_verify_says_it_cannot_run_an_fsdp_save(hf_model_factory, tmp_path):
    hf, _ = make(hf_model_factory, "llama-tp2")
    out = tmp_path / "fsdp"
    assert run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, "--format", "fsdp_dtensor").returncode == 0
    done = run_cli("verify", "--hf", hf, "--mcore", out, "--device", "cpu")
    assert_one_line_error(done, f"--mcore {out}", "an FSDP save", "torch_dist conversion", code=2)
