"""Parallel conversion: `--workers` threads and torchrun ranks (gloo, on this machine) give the single
worker's checkpoint tensor for tensor; megatron-core loads what two ranks wrote; a rank's failure leaves
nothing that looks complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_dense_megatron import TOKENS, expected_megatron_state, megatron_view

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.manifest import check_manifest
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.converters.parallel import READ_AHEAD_BYTES, assign, interleave_streams, run_pieces
from mconvert.formats import dcp_writer
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import TRACKER_FILE, iteration_dir
from mconvert.mcore.parallelism import Parallelism
from mconvert.verify.distributed import run_ranks

REPO = Path(__file__).resolve().parent.parent


def dcp_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole, read through torch's own DCP reader."""
    import torch.distributed.checkpoint as dcp

    release = iteration_dir(checkpoint)
    metadata = dcp.FileSystemReader(str(release)).read_metadata()
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "size")
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(release)), no_dist=True)
    return state


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def assert_megatron_loads(checkpoint: Path, hf: Path, tp: int) -> None:
    """megatron-core's load of `checkpoint` at `tp` ranks holds the HF checkpoint's weights, key for key."""
    _, state, _ = run_ranks(megatron_view, str(checkpoint), TOKENS, tp=tp)
    expected = expected_megatron_state(hf, tp)
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key


def torchrun(nproc: int, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    # A session of its own: a run that hangs is killed with its rank processes, not only torchrun.
    process = subprocess.Popen([*command, "-m", "mconvert", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_pieces_are_spread_evenly_and_completely_over_ranks():
    sizes = [5, 1, 1, 3, 2, 2, 8]
    parts = assign(sizes, 3)
    assert sorted(i for part in parts for i in part) == list(range(len(sizes)))
    assert [sum(sizes[i] for i in part) for part in parts] == [8, 7, 7]


def test_run_pieces_raises_the_first_failure_and_stops_loading():
    loaded = []

    def load(item):
        loaded.append(item)
        if item == 3:
            raise ValueError("piece 3 is bad")
        return item

    with pytest.raises(ValueError, match="piece 3"):
        run_pieces(list(range(1000)), [READ_AHEAD_BYTES] * 1000, load, lambda worker, item, value: None, workers=2)
    assert len(loaded) < 10  # what the memory budget let start, not the rest


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_write_what_one_worker_writes(hf_model_factory, tmp_path, workers):
    hf = hf_model_factory("qwen3-30b-a3b", layers=2)
    one, many = tmp_path / "one", tmp_path / "many"
    convert_hf_to_mcore(hf, one, parallelism=Parallelism(tp=2, ep=2))
    convert_hf_to_mcore(hf, many, parallelism=Parallelism(tp=2, ep=2), workers=workers)
    assert len(list((many / "release").glob("*.distcp"))) == workers
    assert_same(dcp_tensors(one), dcp_tensors(many))

    # Several HF files, which the workers fill side by side, each hashed for the manifest as it fills.
    back_one, back_many = tmp_path / "back-one", tmp_path / "back-many"
    convert_mcore_to_hf(one, back_one, max_shard_size="200KB")
    convert_mcore_to_hf(many, back_many, workers=workers, max_shard_size="200KB")
    assert len(list(back_many.glob("*.safetensors"))) > workers
    assert_same(hf_tensors(back_one), hf_tensors(back_many))
    assert_same(hf_tensors(back_one), hf_tensors(hf))
    for path in back_one.glob("*.safetensors"):
        assert path.read_bytes() == (back_many / path.name).read_bytes()
    assert check_manifest(back_many) == []


def test_a_writer_goes_on_in_new_data_files_and_megatron_loads_them(hf_model_factory, tmp_path, monkeypatch):
    hf = hf_model_factory("qwen2.5-7b-instruct", layers=2)
    whole, split = tmp_path / "whole", tmp_path / "split"
    convert_hf_to_mcore(hf, whole, parallelism=Parallelism(tp=2))
    monkeypatch.setattr(dcp_writer, "DATA_FILE_BYTES", 200_000)
    convert_hf_to_mcore(hf, split, parallelism=Parallelism(tp=2), workers=2)
    sizes = [path.stat().st_size for path in (split / "release").glob("*.distcp")]
    assert len(sizes) > 4 and sum(sizes) == sum(path.stat().st_size for path in (whole / "release").glob("*.distcp"))
    assert check_manifest(split) == []  # each file hashed as it filled, several at once
    assert_same(dcp_tensors(whole), dcp_tensors(split))
    assert_megatron_loads(split, hf, tp=2)


def test_each_record_is_what_torch_save_writes_for_its_chunk(tmp_path):
    """DCPWriter makes a layout's record once (mconvert.formats.torch_save, without torch) and reuses its bytes
    around each later chunk's data: every record, written from memory (contiguous, a slice, a strided view) or
    copied from a file, is torch.save's archive of that chunk (its members, their places but for the pickle's
    memo entries, the storage 64-byte aligned), which torch.load reads back."""
    import io
    import zipfile

    from mconvert.formats.torch_save import tensor_data_start

    chunks = [torch.randn(3, 5).to(torch.bfloat16) for _ in range(4)] + [torch.randn(5, 3).to(torch.bfloat16).t(), torch.arange(5.0)]
    source = tmp_path / "source.bin"
    source.write_bytes(chunks[2].view(torch.uint8).numpy().tobytes() + chunks[3].view(torch.uint8).numpy().tobytes())
    (tmp_path / "out").mkdir()
    writer = dcp_writer.DCPWriter(tmp_path / "out")
    writer.declare("w", (5, 3, 5), torch.bfloat16)
    writer.declare("b", (1, 5), torch.float32)
    writer.write_chunk("w", (0, 0, 0), chunks[0])
    writer.write_chunk("w", (1, 0, 0), torch.cat([chunks[1], chunks[1]])[3:])  # a slice of a larger storage
    writer.copy_chunk("w", (2, 0, 0), (3, 5), [(source, 0, 30)])
    writer.copy_chunk("w", (3, 0, 0), (3, 5), [(source, 30, 10), (source, 40, 20)])
    writer.write_chunk("w", (4, 0, 0), chunks[4])  # not contiguous
    writer.write_chunk("b", (0, 0), chunks[5])
    for (_, _, shape, (name, offset, length)), chunk in zip(writer.local_part().chunks, chunks):
        record = (tmp_path / "out" / name).read_bytes()[offset : offset + length]
        expected = io.BytesIO()
        torch.save(chunk.contiguous().reshape(shape), expected)
        ours, torchs = (zipfile.ZipFile(io.BytesIO(data)).infolist() for data in (record, expected.getvalue()))
        assert [(i.filename, i.file_size) for i in ours if i.filename != "archive/data.pkl"] == \
               [(i.filename, i.file_size) for i in torchs if i.filename != "archive/data.pkl"]
        assert tensor_data_start(tmp_path / "out" / name, offset, length) % 64 == 0
        assert torch.equal(torch.load(io.BytesIO(record)), chunk.reshape(shape))


def test_two_torchrun_ranks_write_the_single_process_checkpoint_and_megatron_loads_it(hf_model_factory, tmp_path):
    hf = hf_model_factory("qwen2.5-7b-instruct", layers=2)
    single, ranked = tmp_path / "single", tmp_path / "ranked"
    convert_hf_to_mcore(hf, single, parallelism=Parallelism(tp=2))
    done = torchrun(2, "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(ranked), "--tp", "2", "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"wrote {ranked}") == 1 and done.stdout.count("next:") == 1  # rank 0's
    files = sorted(p.name for p in (ranked / "release").glob("*.distcp"))
    assert {name.split("_")[2] for name in files} == {"0", "1"}  # __<rank>_<file>.distcp: both ranks wrote
    assert (ranked / TRACKER_FILE).read_text() == "release"
    assert check_manifest(ranked) == []  # rank 1's data file by the digest rank 1 took while writing it
    assert_same(dcp_tensors(single), dcp_tensors(ranked))
    assert_megatron_loads(ranked, hf, tp=2)

    back_single, back_ranked = tmp_path / "back-single", tmp_path / "back-ranked"
    convert_mcore_to_hf(single, back_single, max_shard_size="20MB")
    done = torchrun(2, "mcore-to-hf", "--load-dir", str(ranked), "--save-dir", str(back_ranked), "--max-shard-size", "20MB")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"wrote {back_ranked}") == 1
    assert sorted(p.name for p in back_single.iterdir()) == sorted(p.name for p in back_ranked.iterdir())
    for path in back_single.iterdir():
        assert path.read_bytes() == (back_ranked / path.name).read_bytes(), path.name


def test_a_failing_rank_fails_the_run_and_leaves_nothing_complete(hf_model_factory, tmp_path):
    hf = hf_model_factory("qwen2.5-7b-instruct", layers=2)
    ckpt = tmp_path / "mcore"
    convert_hf_to_mcore(hf, ckpt)
    # Zero the stored final norm: the one rank that converts that piece fails to read it, the other does not.
    release = ckpt / "release"
    dcp = DCPCheckpoint(release)
    for index, info in dcp.metadata.storage_data.items():
        if index.fqn == "decoder.final_layernorm.weight":
            with open(release / info.relative_path, "r+b") as f:
                f.seek(info.offset)
                f.write(bytes(info.length))
    out = tmp_path / "out"
    done = torchrun(2, "mcore-to-hf", "--load-dir", str(ckpt), "--save-dir", str(out))
    assert done.returncode != 0
    # Both ranks name the cause: the one that failed, and the other, which reports it.
    assert done.stderr.count("decoder.final_layernorm.weight") >= 2 and "failed, so nothing was finished" in done.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_streams_are_worked_on_a_few_at_a_time_each_in_order_the_largest_first():
    """Runs of streams A (three of 1 byte), B (one of 5) and C (two of 1), two streams open at a time: B, the
    one with most left, then A; C opens when B is done; each stream's runs in their order."""
    streams, sizes = ["A", "B", "A", "C", "A", "C"], [1, 5, 1, 1, 1, 1]
    order = interleave_streams(streams, sizes, 2)
    assert order == [1, 0, 2, 3, 4, 5]
    assert interleave_streams(streams, sizes, 1) == [0, 2, 4, 1, 3, 5]


def test_run_pieces_keeps_each_stream_in_order_and_runs_within_a_stream():
    stored = []
    items = list(range(300))
    streams = [item % 3 for item in items]
    run_pieces(items, [1 << 20] * len(items), lambda item: item, lambda worker, item, value: stored.append((worker, item)),
               workers=3, streams=streams)
    assert sorted(item for _, item in stored) == items
    for worker in range(3):
        for stream in range(3):
            mine = [item for w, item in stored if w == worker and item % 3 == stream]
            assert mine == sorted(mine)


def test_run_pieces_stores_every_small_item_once_in_order():
    """Small items go between threads in runs: each still loaded, stored and reported once, and each writer
    stores its items in their order."""
    stored, finished = [], []
    items = list(range(500))
    run_pieces(items, [1 << 20] * len(items), lambda item: item * 2, lambda worker, item, value: stored.append((worker, item, value)), workers=2, done=finished.append)
    assert sorted(item for _, item, _ in stored) == items and sorted(finished) == items
    assert all(value == 2 * item for _, item, value in stored)
    for worker in (0, 1):
        mine = [item for w, item, _ in stored if w == worker]
        assert mine == sorted(mine)


def test_run_pieces_runs_tensor_ops_on_one_core_each_and_restores_the_setting():
    """The workers are the parallelism: torch's pool spread over every core mostly spins on copies and scans."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # as on a machine with cores, whatever this one has
    try:
        seen = []
        run_pieces(list(range(4)), [1] * 4, lambda item: seen.append(torch.get_num_threads()), lambda worker, item, value: seen.append(torch.get_num_threads()), workers=2)
        assert seen == [1] * 8
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_default_workers_stop_at_8_and_slices_take_every_core(monkeypatch):
    """The default workers stop at 8 (the disk bounds a copy beyond; a quantized conversion spreads each large tensor
    over every core instead), memory bounding them; the slices' threads are one per core, each rank of a torchrun
    job its share, whatever the worker count."""
    from mconvert import slices
    from mconvert.converters import parallel

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(parallel, "MEMORY_PER_WORKER", 1 << 20)

    def pool_size(workers: int) -> list[int]:
        seen = []
        run_pieces([0], [1], lambda item: seen.append(slices._state["pool"]._max_workers), lambda worker, item, value: None, workers=workers)
        return seen

    assert (parallel.default_workers(), pool_size(1), pool_size(8)) == (8, [64], [64])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert (parallel.default_workers(), pool_size(2)) == (4, [4])
    monkeypatch.setattr(parallel, "MEMORY_PER_WORKER", 1 << 50)
    assert parallel.default_workers() == 1
    assert slices._state == {"pool": None, "users": 0}