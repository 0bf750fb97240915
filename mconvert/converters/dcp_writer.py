"""Writing `torch_dist` checkpoints' DCP part (the format: mconvert.converters.torch_dist): the chunks streamed
into data files as they come, and `.metadata` made with torch's own DCP classes and global save planning, so
that any DCP reader (megatron-core's included) reads it. Apart from the reading side because importing torch's
DCP package (DTensor, sympy) costs about a second, which mcore-to-hf and inspect do without."""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.utils.serialization import config as serialization_config


def _bytes_of(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class DCPWriter:
    """Writes a DCP checkpoint's chunks as they come into data files of this rank (one per writing thread,
    `__<rank>_<file>.distcp`), and keeps their torch save-plan items and storage places; `.metadata` is made
    from those of every rank by torch's own global planning (`write_metadata`)."""

    def __init__(self, directory: Path, files: int = 1, rank: int = 0):
        self.directory = directory
        self._names = [f"__{rank}_{number}.distcp" for number in range(files)]
        self._files = [open(directory / name, "wb") for name in self._names]
        self._declared: dict[str, tuple[TensorProperties, torch.Size]] = {}
        self._items: list[WriteItem] = []
        self._storage: dict[MetadataIndex, _StorageInfo] = {}
        self._staging = [torch.empty(0, dtype=torch.uint8) for _ in range(files)]

    @property
    def data_files(self) -> list[Path]:
        return [self.directory / name for name in self._names]

    def declare(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._declared[key] = (TensorProperties(dtype=dtype), torch.Size(shape))

    def _append(self, file: int, payload: bytes | torch.Tensor) -> _StorageInfo:
        f = self._files[file]
        offset = f.tell()
        if isinstance(payload, bytes):
            f.write(payload)
        else:
            # The zip records' CRC32 costs torch.save five times the write itself; torch.load does not check
            # it (DCP's readers, megatron-core's included, go through torch.load).
            with serialization_config.patch({"save.compute_crc32": False}):
                torch.save(payload, f)
        return _StorageInfo(self._names[file], offset, f.tell() - offset)

    def write_chunk(self, key: str, offsets: tuple[int, ...], chunk: torch.Tensor, file: int = 0) -> None:
        """Write a chunk of `key` at global `offsets` into data file number `file` (one per writing thread)."""
        properties, size = self._declared[key]
        if chunk.dtype != properties.dtype or len(offsets) != len(size):
            raise AssertionError(f"chunk of '{key}' at {offsets} does not fit {properties.dtype} {list(size)}")
        # A layer's (or expert's) region of a stacked tensor is stored with its leading axes of size 1.
        chunk = chunk.reshape((1,) * (len(size) - chunk.dim()) + tuple(chunk.shape))
        if not chunk.is_contiguous():  # a row-parallel chunk (TP > 1)
            chunk = self._staged(file, chunk)
        # torch.save writes a tensor's whole storage: give it one that holds just this chunk. A contiguous
        # slice (a column-parallel chunk, half of fc1) needs no copy: a tensor over just its bytes does.
        if chunk.untyped_storage().nbytes() != chunk.nbytes:
            chunk = torch.from_numpy(chunk.view(torch.uint8).numpy()).view(chunk.dtype)
        info = self._append(file, chunk)
        index = MetadataIndex(key, torch.Size(offsets))
        self._items.append(
            WriteItem(
                index, WriteItemType.SHARD, tensor_data=TensorWriteData(ChunkStorageMetadata(index.offset, chunk.shape), properties, size)
            )
        )
        self._storage[index] = info

    def _staged(self, file: int, chunk: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `chunk` in memory reused from chunk to chunk: fresh memory would cost the
        kernel a page fault and a zeroing per 4 KiB, more than the copy itself."""
        if self._staging[file].numel() < chunk.nbytes:
            self._staging[file] = torch.empty(chunk.nbytes, dtype=torch.uint8)
        staged = self._staging[file][: chunk.nbytes].view(chunk.dtype).view(chunk.shape)
        staged.copy_(chunk)
        return staged

    def write_object(self, key: str, obj: Any, file: int = 0) -> None:
        index = MetadataIndex(key)
        self._storage[index] = self._append(file, _bytes_of(obj))
        self._items.append(WriteItem(index, WriteItemType.BYTE_IO))

    def local_part(self) -> tuple[SavePlan, dict[MetadataIndex, _StorageInfo]]:
        """Close the data files; this rank's save plan and where its items are stored."""
        self.abort()
        return SavePlan(self._items), self._storage

    def finish(self, parts: list[tuple[SavePlan, dict[MetadataIndex, _StorageInfo]]] | None = None) -> None:
        """Write `.metadata`: of what this writer wrote, or of every rank's `local_part` (`parts`)."""
        write_metadata(self.directory, parts if parts is not None else [self.local_part()], self._declared)

    def abort(self) -> None:
        for f in self._files:
            f.close()


def write_metadata(
    directory: Path,
    parts: list[tuple[SavePlan, dict[MetadataIndex, _StorageInfo]]],
    declared: dict[str, tuple[TensorProperties, torch.Size]],
) -> None:
    """`.metadata` from every rank's (save plan, storage places), merged by torch's global save planning,
    once the chunks cover every declared tensor exactly."""
    plans, metadata = create_default_global_save_plan([plan for plan, _ in parts])
    stored = {index: info for _, storage in parts for index, info in storage.items()}
    # The global plan numbers each chunk within its tensor (the index hints readers probe first).
    metadata.storage_data = {item.index: stored[item.index] for plan in plans for item in plan.items}
    for key, (_, size) in declared.items():
        meta = metadata.state_dict_metadata.get(key)
        filled = sum(math.prod(chunk.sizes) for chunk in meta.chunks) if isinstance(meta, TensorStorageMetadata) else 0
        if filled != math.prod(size):
            raise AssertionError(f"'{key}': chunks cover {filled} of {math.prod(size)} elements")
    metadata.version = "1.0.0"
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
