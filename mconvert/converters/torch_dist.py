"""Megatron-Core's `torch_dist` checkpoint format: a torch.distributed.checkpoint (DCP) directory plus
Megatron's own files.

    <dir>/latest_checkpointed_iteration.txt   "release" or an iteration number
    <dir>/release/metadata.json                which backends wrote it
    <dir>/release/common.pt                    torch.save({"args": Namespace, ...}): the model's description
    <dir>/release/.metadata                    DCP metadata: every key's global shape and stored chunks
    <dir>/release/__0_0.distcp                 the chunks, each a torch.save'd tensor, back to back

The writer streams: each chunk is written as it comes and only the metadata is held until the end. The
metadata uses torch's own DCP classes, so any DCP reader (megatron-core's included) reads it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.utils.serialization import config as serialization_config

from mconvert.errors import ConversionError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# megatron-core's checkpoint_version for the current QKV layout.
CHECKPOINT_VERSION = 3.0
# What a module's `_extra_state` holds when Transformer Engine runs without FP8.
EMPTY_EXTRA_STATE = [torch.empty(0, dtype=torch.uint8)]


def _bytes_of(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class DCPWriter:
    """Writes a DCP checkpoint's chunks into one data file as they come, then its `.metadata`."""

    DATA_FILE = "__0_0.distcp"

    def __init__(self, directory: Path):
        self.directory = directory
        self._file = open(directory / self.DATA_FILE, "wb")
        self._state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._filled: dict[str, int] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)

    def declare(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])
        self._filled[key] = 0

    def _append(self, payload: bytes | torch.Tensor) -> tuple[int, int]:
        offset = self._file.tell()
        if isinstance(payload, bytes):
            self._file.write(payload)
        else:
            # The zip records' CRC32 costs torch.save five times the write itself; torch.load does not check
            # it (DCP's readers, megatron-core's included, go through torch.load).
            with serialization_config.patch({"save.compute_crc32": False}):
                torch.save(payload, self._file)
        return offset, self._file.tell() - offset

    def write_chunk(self, key: str, offsets: tuple[int, ...], chunk: torch.Tensor) -> None:
        meta = self._state[key]
        assert isinstance(meta, TensorStorageMetadata)
        if chunk.dtype != meta.properties.dtype or len(offsets) != len(meta.size):
            raise AssertionError(f"chunk of '{key}' at {offsets} does not fit {meta}")
        # A layer's (or expert's) region of a stacked tensor is stored with its leading axes of size 1.
        chunk = chunk.reshape((1,) * (len(meta.size) - chunk.dim()) + tuple(chunk.shape))
        if not chunk.is_contiguous():  # a row-parallel chunk (TP > 1)
            chunk = self._staged(chunk)
        # torch.save writes a tensor's whole storage: give it one that holds just this chunk. A contiguous
        # slice (a column-parallel chunk, half of fc1) needs no copy: a tensor over just its bytes does.
        if chunk.untyped_storage().nbytes() != chunk.nbytes:
            chunk = torch.from_numpy(chunk.view(torch.uint8).numpy()).view(chunk.dtype)
        offset, length = self._append(chunk)
        meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), chunk.shape))
        self._storage[MetadataIndex(key, torch.Size(offsets), len(meta.chunks) - 1)] = _StorageInfo(
            self.DATA_FILE, offset, length
        )
        self._filled[key] += chunk.numel()

    def _staged(self, chunk: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `chunk` in memory reused from chunk to chunk: fresh memory would cost the
        kernel a page fault and a zeroing per 4 KiB, more than the copy itself."""
        if self._staging.numel() < chunk.nbytes:
            self._staging = torch.empty(chunk.nbytes, dtype=torch.uint8)
        staged = self._staging[: chunk.nbytes].view(chunk.dtype).view(chunk.shape)
        staged.copy_(chunk)
        return staged

    def write_object(self, key: str, obj: Any) -> None:
        offset, length = self._append(_bytes_of(obj))
        self._state[key] = BytesStorageMetadata()
        self._storage[MetadataIndex(key)] = _StorageInfo(self.DATA_FILE, offset, length)

    def finish(self) -> None:
        """Write `.metadata` once every declared tensor is filled by its chunks."""
        for key, filled in self._filled.items():
            meta = self._state[key]
            if filled != math.prod(meta.size):
                raise AssertionError(f"'{key}': chunks cover {filled} of {math.prod(meta.size)} elements")
        self._file.close()
        metadata = Metadata(state_dict_metadata=self._state, storage_data=self._storage, version="1.0.0")
        with open(self.directory / ".metadata", "wb") as f:
            pickle.dump(metadata, f)

    def abort(self) -> None:
        self._file.close()


def write_common(release_dir: Path, args: argparse.Namespace) -> None:
    """metadata.json and common.pt: what megatron-core reads besides the DCP files."""
    (release_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))
    torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, release_dir / "common.pt")


def write_tracker(checkpoint_dir: Path) -> None:
    (checkpoint_dir / TRACKER_FILE).write_text(RELEASE)


def read_args(release_dir: Path) -> argparse.Namespace:
    """The Megatron-LM args stored in a checkpoint's common.pt (unpickling only what args hold)."""
    path = release_dir / "common.pt"
    if not path.exists():
        raise ConversionError(f"{path}: missing (no Megatron args stored with the checkpoint)")
    # The context manager removes on exit what it added, even if it was allowed before (megatron-core allows
    # Namespace process-wide on import): add only what is missing.
    missing = [cls for cls in (argparse.Namespace,) if cls not in torch.serialization.get_safe_globals()]
    with torch.serialization.safe_globals(missing):
        common = torch.load(path, map_location="cpu", weights_only=True)
    if "args" not in common:
        raise ConversionError(f"{path}: holds no 'args'")
    return common["args"]
