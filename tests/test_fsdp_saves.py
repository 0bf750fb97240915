"""The export from Megatron-LM's FSDP saves (fsdp_dtensor, torch_dcp): how names are read, and what it refuses,
on DCP folders written by torch's `dcp.save` of a state dict nested as Megatron-LM nests it. Megatron-LM's real
saves, made on a GPU, are held in tests/fixtures/fsdp (tests/test_fsdp_fixtures.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_runner import assert_nothing_left, assert_one_line_error, run_cli

from mconvert.converters.mcore_sources import open_megatron_checkpoint
from mconvert.mcore.checkpoint import TRACKER_FILE


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


def test_the_export_reads_the_names_as_megatron_lm_nests_them(tmp_path):
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
    save = open_megatron_checkpoint(tmp_path / "fsdp")
    assert save.format == "fsdp_dtensor" and save.args.pipeline_model_parallel_size == 1
    assert save.entries[("mlp.linear_fc1.weight", 0, None)] == (
        "model.module.decoder.layers.0.mlp.linear_fc1.weight_w", "model.module.decoder.layers.0.mlp.linear_fc1.weight_v")
    assert ("mlp.experts.experts.linear_fc2.weight", 1, 5) in save.entries
    assert ("mtp.layers.0.transformer_layer.input_layernorm.weight", None, None) in save.entries
    megatron_lm_save(tmp_path / "dcp", {"decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate, up])}, "")
    assert open_megatron_checkpoint(tmp_path / "dcp").format == "torch_dcp"


@pytest.mark.parametrize("model, args, expected", [
    ({"decoder.layers.0.mlp.linear_fc1.weight_w": torch.ones(2, 2)}, {}, "has its gate half alone"),
    ({"decoder.layers.0.mlp.linear_fc2.weight": torch.ones(2, 2)}, {"pipeline_model_parallel_size": 2}, "2 pipeline stages"),
    ({}, {}, "without model weights"),
])
def test_saves_the_export_cannot_read_end_in_one_line(model, args, expected, tmp_path):
    megatron_lm_save(tmp_path / "save" / "iter_0000007", model, "module.", **args)
    (tmp_path / "save" / TRACKER_FILE).write_text("7")
    done = run_cli("mcore-to-hf", "--load-dir", tmp_path / "save", "--save-dir", tmp_path / "out")
    assert_one_line_error(done, "iter_0000007", expected)
    assert_nothing_left(tmp_path / "out")


def test_verify_says_it_cannot_run_an_fsdp_save(hf_model_factory):
    save = Path(__file__).parent / "fixtures" / "fsdp" / "torch_dcp-llama" / "save"
    done = run_cli("verify", "--hf", hf_model_factory("llama-3.1-8b"), "--mcore", save, "--device", "cpu")
    assert_one_line_error(done, f"--mcore {save}", "an FSDP save", "torch_dist conversion", code=2)
