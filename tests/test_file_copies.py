"""hf-to-mcore copies a chunk file to file when it is runs of stored HF bytes (`FileCopies`): the runs must
be exactly the bytes the in-memory path builds for that chunk (transform, cut), for every family's layout."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import numpy as np
import torch
from test_parallel import assert_same, dcp_tensors

from mconvert.converters.hf_to_mcore import FileCopies, convert_hf_to_mcore, fused_expert_layers, piece_parts, rows_of
from mconvert.converters.manifest import check_manifest
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.converters.plan import build_plan
from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
from mconvert.formats.quantized import fp8_block_size
from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism


def memory_chunk(piece, parts, offsets) -> np.ndarray:
    """The chunk at `offsets` as the in-memory path cuts it (hf_to_mcore.write_piece)."""
    axis = piece.layout.split_axis or 0
    for chunk_offsets, cut in piece.chunks():
        if chunk_offsets == offsets:
            whole = parts if axis == 0 else [rows_of(parts, slice(None))]
            return rows_of(whole, cut) if axis == 0 else whole[0][(slice(None),) * axis + (cut,)]
    raise AssertionError(f"no chunk at {offsets}")


def span_bytes(spans) -> bytes:
    data = bytearray()
    for path, begin, length in spans:
        with open(path, "rb") as f:
            f.seek(begin)
            data += f.read(length)
    return bytes(data)


@pytest.mark.parametrize(
    "model, parallelism, least",
    [
        ("qwen2.5-7b-instruct", Parallelism(), 0.25),
        ("qwen2.5-7b-instruct", Parallelism(tp=2), 0.15),
        ("qwen3-30b-a3b", Parallelism(), 0.4),
        ("qwen3-30b-a3b", Parallelism(tp=2, ep=2), 0.2),
        ("mixtral-8x7b-v0.1", Parallelism(tp=2), 0.4),
        ("deepseek-v2-lite", Parallelism(), 0.4),
    ],
)
def test_file_chunks_are_the_bytes_the_memory_path_builds(hf_model_factory, model, parallelism, least):
    directory = hf_model_factory(model)
    config = read_hf_config(directory, "--load-dir")
    family, spec = get_mapping(config, None, source=str(directory))
    hf = HFCheckpoint(directory, fp8_block_size(config))
    plan = build_plan(family, spec, parallelism, None, fused_expert_layers(family, spec, hf))
    copies = FileCopies(hf, plan.spec, directory)
    copied = total = 0
    for piece in plan.pieces:
        dtype = plan.dtype_of(piece)
        nbytes = sum(hf.nbytes(ref.name, ref.index) for ref in piece.sources)
        total += nbytes
        chunks = copies.chunks(piece, dtype)
        if chunks is None:
            continue
        copied += nbytes
        parts = piece_parts(piece, [hf.read(ref.name, ref.index) for ref in piece.sources], plan.spec, dtype)
        assert [offsets for offsets, _ in piece.chunks()] == [offsets for offsets, _, _ in chunks]
        for offsets, shape, spans in chunks:
            expected = memory_chunk(piece, parts, offsets)
            assert tuple(expected.shape) == shape, piece.key
            assert span_bytes(spans) == np.ascontiguousarray(expected).view(np.uint8).tobytes(), (piece.key, piece.offsets, offsets)
            assert all(os.path.isfile(path) for path, _, _ in spans)
    # The path is taken (these shrunk models' bytes are mostly their padded embeddings, built in memory).
    assert copied >= least * total, f"{copied} of {total} bytes copied file to file"


def test_a_cast_or_a_regrouping_is_built_in_memory(hf_model_factory):
    directory = hf_model_factory("qwen2.5-7b-instruct")  # float32
    config = read_hf_config(directory, "--load-dir")
    family, spec = get_mapping(config, None, source=str(directory))
    hf = HFCheckpoint(directory, fp8_block_size(config))
    plan = build_plan(family, spec, Parallelism(), torch.bfloat16, frozenset())
    assert all(FileCopies(hf, plan.spec, directory).chunks(piece, plan.dtype_of(piece)) is None for piece in plan.pieces)
    plan = build_plan(family, spec, Parallelism(), None, frozenset())
    qkv = [piece for piece in plan.pieces if piece.key.endswith("linear_qkv.weight")]
    assert qkv and all(FileCopies(hf, plan.spec, directory).chunks(piece, plan.dtype_of(piece)) is None for piece in qkv)


def test_copies_between_file_systems_pass_through_memory(hf_model_factory, tmp_path):
    """The kernel copies only within one file system (copy_file_range fails with EXDEV across two): both
    directions still write what they write on one, into a tmpfs."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system (/dev/shm) here")
    hf = hf_model_factory("qwen3-30b-a3b")
    same = tmp_path / "same"
    convert_hf_to_mcore(hf, same)
    convert_mcore_to_hf(same, tmp_path / "back")
    other = Path(tempfile.mkdtemp(dir=shm))
    try:
        convert_hf_to_mcore(hf, other / "mcore")
        assert check_manifest(other / "mcore") == []
        assert_same(dcp_tensors(same), dcp_tensors(other / "mcore"))
        convert_mcore_to_hf(same, other / "back")
        assert check_manifest(other / "back") == []
        for path in (tmp_path / "back").glob("*.safetensors"):
            assert path.read_bytes() == (other / "back" / path.name).read_bytes()
    finally:
        shutil.rmtree(other)
