"""The tensor-by-tensor random checkpoints (benchmarks, GPU runs) have exactly the names and shapes that
transformers' own save_pretrained writes, MoE experts in the hub's per-expert layout included."""

import pytest

from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.full_size import write_random_hf_checkpoint
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b-v0.1"])
def test_streamed_checkpoint_matches_save_pretrained(name, tmp_path):
    config = shrink(real_config(name), layers=3)
    if name == "qwen3-30b-a3b":
        config["mlp_only_layers"] = [1]
    saved = HFCheckpoint(make_hf_checkpoint(config, tmp_path / "saved")).tensors
    streamed = HFCheckpoint(write_random_hf_checkpoint(config, tmp_path / "streamed")).tensors
    assert {n: t.shape for n, t in streamed.items()} == {n: t.shape for n, t in saved.items()}
