"""The real client: checkpoints that megatron-core itself saved (its GPTModel at TP=2 x PP=2 on gloo CPU
ranks), in torch_dist through `dist_checkpointing.save` and in the legacy per-rank `torch` format as
Megatron-LM writes it, export to the original HF tensors bit for bit; and the same ranks hand out HF weights
directly (the RL weight-sync path), gathered over their TP groups."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.rank_export import gather_hf_weights
from mconvert.converters.safetensors_io import HFCheckpoint
from mconvert.converters.torch_dist import TRACKER_FILE, read_args, RELEASE

# The megatron-core harness (CPU shims, gloo ranks, model loading) lives in mconvert.verify.
run_ranks = pytest.importorskip("mconvert.verify.distributed").run_ranks
load_model = pytest.importorskip("mconvert.verify.megatron_side").load_model

TP, PP = 2, 2


def read_hf(directory: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(directory)
    return {name: checkpoint.read(name) for name in checkpoint.tensors}


def save_as_megatron_does(ours: str, hf_dir: str, dist_dir: str, legacy_dir: str) -> list[str]:
    """In each rank: load our checkpoint into megatron-core's GPTModel; save it with megatron-core's own
    dist_checkpointing and, per rank, in Megatron-LM's legacy format; then gather HF weights from the live
    model and check them against the HF originals. Returns the HF names all ranks produced (on rank 0)."""
    from megatron.core import dist_checkpointing, parallel_state

    args = read_args(Path(ours) / RELEASE)
    (model,) = load_model(ours, args, torch.float32, transformer_impl="local")

    dist_checkpointing.save(model.sharded_state_dict(), dist_dir)

    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    rank_dir = Path(legacy_dir) / "iter_0000010" / f"mp_rank_{tp:02d}_{pp:03d}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    # What Megatron-LM's save_checkpoint stores besides the model (RNG state with numpy's, optimizer state).
    rng_state = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(), "torch_rng_state": torch.get_rng_state()}
    optimizer = {"state": {i: {"exp_avg": torch.zeros_like(p)} for i, p in enumerate(model.parameters())}}
    saved_args = argparse.Namespace(**{**vars(args), "tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP})
    state = {"args": saved_args, "checkpoint_version": 3.0, "iteration": 10, "model": model.state_dict(), "optimizer": optimizer, "rng_state": [rng_state]}
    torch.save(state, rank_dir / "model_optim_rng.pt")
    if dist.get_rank() == 0:
        (Path(legacy_dir) / TRACKER_FILE).write_text("10")

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    original = read_hf(Path(hf_dir))
    produced = []
    for name, tensor in gather_hf_weights(model, config):
        assert torch.equal(tensor, original[name]), name
        produced.append(name)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, produced)
    return sorted({name for names in everyone for name in names})


@pytest.mark.parametrize("name, overrides", [("llama-3.1-8b", {}), ("qwen2.5-7b-instruct", {"tie_word_embeddings": True})], ids=["llama", "qwen2-tied"])
def test_checkpoints_megatron_core_saved_export_bit_exact(name, overrides, hf_model_factory, tmp_path, capsys):
    hf = hf_model_factory(name, layers=4, **overrides)
    convert_hf_to_mcore(hf, tmp_path / "ours")
    (tmp_path / "megatron-dist").mkdir()
    produced = run_ranks(
        save_as_megatron_does, str(tmp_path / "ours"), str(hf), str(tmp_path / "megatron-dist"), str(tmp_path / "megatron-legacy"), tp=TP, pp=PP
    )
    original = read_hf(hf)
    assert produced == sorted(original)

    # megatron-core's bare dist_checkpointing.save stores no args: the reference config describes the model.
    for load_dir, flags in ((tmp_path / "megatron-dist", ["--hf-config", str(hf)]), (tmp_path / "megatron-legacy", [])):
        out = tmp_path / f"{load_dir.name}-hf"
        assert main(["mcore-to-hf", "--load-dir", str(load_dir), "--save-dir", str(out), *flags]) == 0, capsys.readouterr().err
        back = read_hf(out)
        assert sorted(back) == sorted(original)
        assert all(torch.equal(back[k], original[k]) for k in original), load_dir.name
