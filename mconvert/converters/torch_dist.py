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

from mconvert.converters.pickles import load_megatron_file
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


def _load_common(path: Path) -> dict:
    """common.pt's dict, running nothing it names (see mconvert.converters.pickles)."""
    common = load_megatron_file(path, str(path))
    if not isinstance(common, dict):
        raise ConversionError(f"{path}: holds a {type(common).__name__}, not a dict")
    return common


def read_args(release_dir: Path) -> argparse.Namespace:
    """The Megatron-LM args a checkpoint was saved with; an error when it stores none."""
    args = read_common_args(release_dir)
    if args is None:
        raise ConversionError(f"{release_dir}: no Megatron args stored with the checkpoint (no 'args' in its common state)")
    return args


# --- Reading ---------------------------------------------------------------------------------------------

# What a DCP `.metadata` pickle may name: torch's own DCP classes, torch.Size, dtypes and layouts (and the
# save plans megatron-core keeps in it). Anything else (it is a pickle: it could name any callable) is refused
# rather than run.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"'{module}.{name}' is not allowed in DCP metadata")


def iteration_dir(load_dir: Path, iteration: int | None = None) -> Path:
    """The directory of one saved iteration: `--iteration N`'s `iter_000000N`, else the one the tracker file
    names (`release` or a number), else `load_dir` itself when it holds the checkpoint files directly."""
    if not load_dir.is_dir():
        raise ConversionError(f"{load_dir}: not a directory")
    if iteration is not None:
        directory = load_dir / f"iter_{iteration:07d}"
        if not directory.is_dir():
            saved = sorted(p.name for p in load_dir.glob("iter_*")) + ([RELEASE] if (load_dir / RELEASE).is_dir() else [])
            raise ConversionError(f"--iteration {iteration}: {directory} does not exist (saved: {', '.join(saved) or 'none'})")
        return directory
    tracker = load_dir / TRACKER_FILE
    if tracker.exists():
        text = tracker.read_text().strip()
        if text == RELEASE:
            return load_dir / RELEASE
        if not text.isdigit():
            raise ConversionError(f"{tracker}: holds '{text}', neither 'release' nor an iteration number")
        return load_dir / f"iter_{int(text):07d}"
    return load_dir


class DCPCheckpoint:
    """A DCP checkpoint directory opened for reading: every key's global shape from `.metadata`, and any
    region of a tensor, assembled from the stored chunks it intersects (however the saver chunked it)."""

    def __init__(self, directory: Path):
        self.directory = directory
        path = directory / ".metadata"
        if not path.exists():
            raise ConversionError(f"{directory}: no .metadata (not a torch_dist checkpoint)")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise ConversionError(f"{path}: unreadable DCP metadata ({e})") from None
        if not isinstance(metadata, Metadata):
            raise ConversionError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        self.metadata = metadata
        self.shapes: dict[str, tuple[int, ...]] = {
            key: tuple(meta.size)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        self.dtypes: dict[str, torch.dtype] = {
            key: meta.properties.dtype
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        self.object_keys = [k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)]
        for data_file in sorted({info.relative_path for info in metadata.storage_data.values()}):
            if not (directory / data_file).is_file():
                raise ConversionError(f"{directory / data_file}: data file named in {path.name} is missing")

    def _storage(self, index: MetadataIndex) -> _StorageInfo:
        info = self.metadata.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{self.directory}: '{index.fqn}' is stored transformed ({info.transform_descriptors}), which is not supported")
        return info

    def _read_bytes(self, index: MetadataIndex) -> bytes:
        info = self._storage(index)
        path = self.directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise ConversionError(f"{path}: truncated while reading '{index.fqn}'")
        return data

    def _load_chunk(self, key: str, number: int) -> torch.Tensor:
        chunk = self.metadata.state_dict_metadata[key].chunks[number]
        info = self._storage(MetadataIndex(key, chunk.offsets, number))
        # torch.load reads the chunk's archive in place, through a window on the file: no copy of its bytes.
        with open(self.directory / info.relative_path, "rb") as f:
            try:
                window = io.BufferedReader(_FileWindow(f, info.offset, info.length), buffer_size=1 << 20)
                tensor = torch.load(window, map_location="cpu", weights_only=True)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
                reason = (str(e) or type(e).__name__).splitlines()[0]
                raise ConversionError(f"{self.directory / info.relative_path}: chunk {number} of '{key}' is unreadable ({reason})") from None
        if tensor.numel() != math.prod(chunk.sizes):
            raise ConversionError(f"{self.directory}: chunk {number} of '{key}' holds {tensor.numel()} elements, metadata says {list(chunk.sizes)}")
        return tensor.reshape(tuple(chunk.sizes))

    def read_object(self, key: str) -> Any:
        """An object stored with `torch.save` under `key`, running nothing it names."""
        return load_megatron_file(io.BytesIO(self._read_bytes(MetadataIndex(key))), f"{self.directory}: '{key}'")

    def read_regions(self, regions: list[tuple[str, tuple[int, ...], tuple[int, ...]]]):
        """Yield, for each (key, offsets, shape) in order, that region of the tensor `key`.

        Each stored chunk is read once: a chunk that several regions need is kept until the last of them is
        served, then dropped. Regions ordered by key and offset keep that to the chunks of one key at a time.
        """
        needs: list[list[int]] = []
        uses: dict[tuple[str, int], int] = {}
        by_first_offset: dict[str, tuple[dict[int, list[int]], list[int]]] = {}
        for key, offsets, shape in regions:
            chunks = self.metadata.state_dict_metadata[key].chunks
            if key not in by_first_offset:
                # Chunks one row thick along the first axis (a layer's) are found by that row, not by a scan.
                thin: dict[int, list[int]] = {}
                wide: list[int] = []
                for n, chunk in enumerate(chunks):
                    if len(chunk.sizes) and chunk.sizes[0] == 1:
                        thin.setdefault(chunk.offsets[0], []).append(n)
                    else:
                        wide.append(n)
                by_first_offset[key] = (thin, wide)
            thin, wide = by_first_offset[key]
            candidates = wide + [n for row in range(offsets[0], offsets[0] + shape[0]) for n in thin.get(row, ())] if shape else wide
            hit = sorted(n for n in candidates if region_overlap(chunks[n].offsets, chunks[n].sizes, offsets, shape) is not None)
            needs.append(hit)
            for n in hit:
                uses[(key, n)] = uses.get((key, n), 0) + 1
        loaded: dict[tuple[str, int], torch.Tensor] = {}
        for (key, offsets, shape), hit in zip(regions, needs):
            out = torch.empty(shape, dtype=self.dtypes[key])
            covered = 0
            for n in hit:
                if (key, n) not in loaded:
                    loaded[(key, n)] = self._load_chunk(key, n)
                chunk_meta = self.metadata.state_dict_metadata[key].chunks[n]
                within_chunk, within_out = region_overlap(chunk_meta.offsets, chunk_meta.sizes, offsets, shape)
                part = loaded[(key, n)][within_chunk]
                out[within_out] = part
                covered += part.numel()
                uses[(key, n)] -= 1
                if uses[(key, n)] == 0:
                    del loaded[(key, n)]
            if covered != out.numel():
                raise ConversionError(f"{self.directory}: the stored chunks of '{key}' cover {covered} of the {out.numel()} elements at {list(offsets)}")
            yield out


class _FileWindow(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file of their own."""

    def __init__(self, file, offset: int, length: int):
        self._file, self._offset, self._length, self._position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(base + position, 0), self._length)
        return self._position

    def readinto(self, buffer) -> int:
        size = min(len(buffer), self._length - self._position)
        self._file.seek(self._offset + self._position)
        read = self._file.readinto(memoryview(buffer)[:size])
        self._position += read
        return read


def region_overlap(chunk_offsets, chunk_sizes, offsets, shape) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices of a chunk and of a region selecting what they share, or None when they share nothing."""
    in_chunk, in_region = [], []
    for c0, cn, r0, rn in zip(chunk_offsets, chunk_sizes, offsets, shape):
        begin, end = max(c0, r0), min(c0 + cn, r0 + rn)
        if begin >= end:
            return None
        in_chunk.append(slice(begin - c0, end - c0))
        in_region.append(slice(begin - r0, end - r0))
    return tuple(in_chunk), tuple(in_region)


def read_common_args(release_dir: Path, dcp: DCPCheckpoint | None = None) -> argparse.Namespace | None:
    """The Megatron-LM args a checkpoint was saved with, or None when it has none (megatron-core's
    `dist_checkpointing.save` of a bare model's state). megatron-core up to 0.16 keeps the common state in
    `common.pt`; later ones store it as a `common_state` object among the DCP shards instead."""
    if (release_dir / "common.pt").exists():
        return _load_common(release_dir / "common.pt").get("args")
    if dcp is None:
        if not (release_dir / ".metadata").exists():
            raise ConversionError(f"{release_dir}: not a torch_dist checkpoint (no common.pt, no .metadata)")
        dcp = DCPCheckpoint(release_dir)
    for key in dcp.object_keys:
        if key.split("/")[0] != "common_state":
            continue
        common = dcp.read_object(key)
        if isinstance(common, list) and common:
            common = common[0]  # Megatron-LM 0.19's training saves hold it in a one-element list
        args = common.get("args") if isinstance(common, dict) else None
        if isinstance(args, argparse.Namespace):
            return args
    return None
