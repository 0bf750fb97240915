"""mcore-to-hf loses nothing without a word: every tensor of the Megatron save is read by the plan or is the
optimizer's; a save tensor nothing reads (an unknown module, a layer beyond num_layers) stops the export in one line,
nothing written."""

from __future__ import annotations

import shutil

import pytest
import torch

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.formats import dcp_writer
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import RELEASE, TRACKER_FILE
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli


def with_tensor(mcore, out, key: str, shape: tuple[int, ...], like: str) -> None:
    """The torch_dist save `mcore` rewritten into `out` with one more tensor `key` (of `like`'s dtype)."""
    release = mcore / RELEASE
    dcp = DCPCheckpoint(release)
    (out / RELEASE).mkdir(parents=True)
    shutil.copy(mcore / TRACKER_FILE, out / TRACKER_FILE)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(release / name, out / RELEASE / name)
    writer = dcp_writer.DCPWriter(out / RELEASE)
    for name, stored in dcp.shapes.items():
        writer.declare(name, stored, dcp.dtypes[name])
    writer.declare(key, shape, dcp.dtypes[like])
    for name, stored in dcp.shapes.items():
        writer.write_chunk(name, (0,) * len(stored), dcp.read_region(name, (0,) * len(stored), stored))
    writer.write_chunk(key, (0,) * len(shape), torch.zeros(shape, dtype=dcp.dtypes[like]))
    writer.finish()


@pytest.mark.parametrize(
    "key",
    [
        "vision_model.patch_embed.weight",  # a module outside the model's keys: was skipped without a word
        "decoder.layers.self_attention.linear_qkv.extra.weight",  # a module the mapping does not know
    ],
)
def test_a_save_tensor_nothing_reads_is_named_in_one_line(key, hf_model_factory, tmp_path):
    hf = hf_model_factory("llama-3.1-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    with_tensor(tmp_path / "mcore", tmp_path / "extra", key, (4, 8), "embedding.word_embeddings.weight")
    failed = run_cli("mcore-to-hf", "--load-dir", tmp_path / "extra", "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, f"tensor '{key}' is not used by the llama mapping")
    assert_nothing_left(tmp_path / "back")


def test_a_layer_beyond_num_layers_is_named_in_one_line(hf_model_factory, tmp_path, capsys):
    """Mixed dense and MoE layers are stored one key a layer: a third layer's tensor in a save of two."""
    hf = hf_model_factory("qwen3-30b-a3b", layers=2, mlp_only_layers=[0])
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    stored = DCPCheckpoint(tmp_path / "mcore" / RELEASE).shapes
    layer_key = next(key for key in stored if key.startswith("decoder.layers.1."))
    extra = layer_key.replace("decoder.layers.1.", "decoder.layers.2.")
    with_tensor(tmp_path / "mcore", tmp_path / "extra", extra, stored[layer_key], layer_key)
    capsys.readouterr()
    assert main(["mcore-to-hf", "--load-dir", str(tmp_path / "extra"), "--save-dir", str(tmp_path / "back")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"tensor '{extra}' is not used by the qwen3_moe mapping" in err, err
    assert_nothing_left(tmp_path / "back")
