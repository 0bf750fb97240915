"""Reading a torch.distributed.checkpoint (DCP) directory: every key's global shape and stored chunks from
`.metadata`, and any region of a tensor assembled from the chunks it intersects, however the saver chunked it.

`.metadata`'s pickle is read into plain records rather than torch's DCP classes: importing
torch.distributed.checkpoint (DTensor, sympy) took a third of mcore-to-hf's start (1.0 of 3.1 s), and reading
needs only the fields the records keep. Tensors come back as numpy arrays (mconvert.dtypes), through
mconvert.formats.pickles where a chunk is not plainly stored: reading never imports torch. Writing:
mconvert.formats.dcp_writer."""

from __future__ import annotations

import collections
import io
import itertools
import math
import os
import pathlib
import pickle
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.dtypes import STORED, strided
from mconvert.errors import ConversionError
from mconvert.formats.pickles import load_megatron_file
from mconvert.formats.torch_save import (
    contiguous_strides,
    member,
    member_start,
    record_entries,
    saved_tensor_layout,
)

# What a DCP `.metadata` pickle may name: torch's DCP classes (read as records, below), torch.Size, dtypes (read
# as numpy's) and layouts. Anything else (it is a pickle: it could name any callable) is refused rather than run.
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",  # _StorageInfo
    "torch.distributed.checkpoint.planner",  # the save plans megatron-core keeps in the metadata
)
# torch's own FileSystemWriter records the checkpoint's path (a pathlib path) in the metadata's storage_meta;
# megatron-core's writer does too when it writes through the multi-storage client.
_METADATA_GLOBALS = {
    ("torch", "Size"): tuple, ("torch.serialization", "_get_layout"): str, ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
}


class _Record:
    """An object of DCP's metadata as its pickle stores it: its fields as attributes (an enum member, pickled
    as a call with its value: that value)."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:  # TensorProperties': dtype, layout, grad, format, pinned
            state = {"dtype": state[0]}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"a {type(self).__name__} stored as {type(state).__name__}, not as its fields")
        self.__dict__.update(state)


class _Metadata(_Record):
    """torch.distributed.checkpoint.metadata.Metadata"""


class _TensorEntry(_Record):
    """TensorStorageMetadata: a tensor's properties, global size and stored chunks (offsets, sizes)."""


class _BytesEntry(_Record):
    """BytesStorageMetadata: an object stored with torch.save."""


_RECORDS = {"Metadata": _Metadata, "TensorStorageMetadata": _TensorEntry, "BytesStorageMetadata": _BytesEntry}


class _MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler, not its C one: that one sizes its memo by the largest index a pickle names (a
    mutated LONG_BINPUT asked it for 13 GB); this one keeps its memo in a dict, bounded by the pickle's length, at the
    cost of unpickling in Python."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            return _RECORDS.get(name, _Record)
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[module, name]
        if module == "torch" and name in STORED:
            return STORED[name]
        raise pickle.UnpicklingError(f"'{module}.{name}' is not allowed in DCP metadata")


def _placed(info: Any) -> bool:
    """Whether a storage record says where its bytes are: a non-negative `offset` and `length`."""
    return all(isinstance(getattr(info, field, None), int) and getattr(info, field) >= 0 for field in ("offset", "length"))


def _stored_at(fqn: str, offsets: Any = None) -> tuple[str, tuple[int, ...] | None]:
    """Where `.metadata` files a stored item: its key, and a tensor chunk's global offsets."""
    return fqn, None if offsets is None else tuple(offsets)


class DCPCheckpoint:
    """A DCP checkpoint directory opened for reading: every key's global shape from `.metadata`, and any
    region of a tensor, assembled from the stored chunks it intersects (however the saver chunked it)."""

    def __init__(self, directory: Path):
        self.directory = directory
        path = directory / ".metadata"
        if not path.exists():
            raise ConversionError(f"{directory}: no .metadata (not a torch_dist checkpoint)")
        try:
            # From memory: a length the pickle claims is then bounded by the file's, not allocated as claimed.
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
            if not isinstance(metadata, _Metadata):
                raise ConversionError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
            if (odd := next((k for k in metadata.state_dict_metadata if not isinstance(k, str)), None)) is not None:
                raise ConversionError(f"{path}: names a stored value {odd!r}, which is not a name")
            tensors = {key: meta for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, _TensorEntry)}
            self.shapes: dict[str, tuple[int, ...]] = {key: tuple(meta.size) for key, meta in tensors.items()}
            self.dtypes: dict[str, np.dtype] = {key: meta.properties.dtype for key, meta in tensors.items()}
            self.object_keys = [k for k, m in metadata.state_dict_metadata.items() if isinstance(m, _BytesEntry)]
            # A MetadataIndex of an object has no offset (torch's __init__ sets none).
            self._stored = {_stored_at(index.fqn, getattr(index, "offset", None)): info for index, info in metadata.storage_data.items()}
            data_files = sorted({info.relative_path for info in self._stored.values()})
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001 (corrupt bytes fail the unpickler in many ways, records lacking torch's fields too)
            raise ConversionError(f"{path}: unreadable DCP metadata ({e})") from None
        self.metadata = metadata
        self._chunk_index: dict[str, RegionIndex] = {}  # per key: its chunks' numbers, by their regions
        self._records: dict[tuple[str, int], int | None] = {}
        self._threads = threading.local()
        for data_file in data_files:
            if not isinstance(data_file, str) or Path(data_file).name != data_file or data_file in ("", ".", ".."):
                raise ConversionError(f"{path}: names data file {data_file!r}, not a file beside it")
            if not (directory / data_file).is_file():
                raise ConversionError(f"{directory / data_file}: data file named in {path.name} is missing")
        try:
            self._check_claims(tensors, {name: (directory / name).stat().st_size for name in data_files})
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001 (chunk records of other types than torch writes, as above)
            raise ConversionError(f"{path}: unreadable DCP metadata ({e})") from None

    def _check_claims(self, tensors: dict[str, _TensorEntry], file_sizes: dict[str, int]) -> None:
        """Every tensor's bytes are on disk: each chunk lies within its tensor, its bytes within its record, its record
        within its data file, and the chunks hold at least the tensor's elements; every stored object's record lies
        within its file. Reading a tensor, a region of it or an object then never allocates more than the checkpoint's
        files hold, whatever sizes `.metadata` claims."""
        path = self.directory / ".metadata"
        for key, meta in tensors.items():
            shape, itemsize, held = self.shapes[key], self.dtypes[key].itemsize, 0
            for n, chunk in enumerate(meta.chunks):
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)
                ):
                    raise ConversionError(f"{path}: chunk {n} of '{key}' ({list(sizes)} at {list(offsets)}) lies outside its shape {list(shape)}")
                info = self._stored.get(_stored_at(key, offsets))
                if info is None:
                    raise ConversionError(f"{path}: chunk {n} of '{key}' is stored nowhere")
                if not _placed(info):
                    raise ConversionError(f"{path}: the record of where chunk {n} of '{key}' is stored has no place in its file")
                data, end = self.directory / info.relative_path, info.offset + info.length
                if end > file_sizes[info.relative_path]:
                    raise ConversionError(f"{data}: truncated (chunk {n} of '{key}' ends at byte {end}, the file has {file_sizes[info.relative_path]})")
                elements = math.prod(sizes)
                if elements * itemsize > info.length:
                    raise ConversionError(f"{path}: chunk {n} of '{key}' claims {elements * itemsize} bytes, its record in {data.name} holds {info.length}")
                held += elements
            if math.prod(shape) > held:
                raise ConversionError(f"{path}: '{key}' of shape {list(shape)} claims {math.prod(shape)} elements, its chunks hold {held}")
        for key in self.object_keys:
            info = self._stored.get(_stored_at(key))
            if _placed(info) and info.offset + info.length > file_sizes.get(info.relative_path, 0):
                raise ConversionError(f"{self.directory / info.relative_path}: truncated (the object '{key}' ends at byte {info.offset + info.length})")

    def _storage(self, key: str, offsets: Any = None) -> _Record:
        """Where an object (`key`) or a tensor's chunk (`key` at `offsets`) is stored: its data file's
        `relative_path`, and the `offset` and `length` of its record there."""
        info = self._stored[_stored_at(key, offsets)]
        if getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{self.directory}: '{key}' is stored transformed ({info.transform_descriptors}), which is not supported")
        if not _placed(info):
            raise ConversionError(f"{self.directory / '.metadata'}: the record of where '{key}' is stored has no place in its file")
        return info

    def _load_chunk(self, key: str, number: int) -> np.ndarray:
        """Chunk `number` of `key` through the unpickler: a chunk not stored as a plain tensor (a view into a larger
        storage, a dtype without a typed storage)."""
        chunk = self.metadata.state_dict_metadata[key].chunks[number]
        info = self._storage(key, chunk.offsets)
        path = self.directory / info.relative_path
        tensor = load_megatron_file(path, f"{path}: chunk {number} of '{key}'", info.offset, info.length)
        if not isinstance(tensor, np.ndarray) or tensor.size != math.prod(chunk.sizes):
            held = f"{tensor.size} elements" if isinstance(tensor, np.ndarray) else f"a {type(tensor).__name__}"
            raise ConversionError(f"{self.directory}: chunk {number} of '{key}' holds {held}, metadata says {list(chunk.sizes)}")
        return tensor.reshape(tuple(chunk.sizes))

    def read_object(self, key: str) -> Any:
        """An object stored with `torch.save` under `key`, running nothing it names."""
        info = self._storage(key)
        return load_megatron_file(self.directory / info.relative_path, f"{self.directory}: '{key}'", info.offset, info.length)

    def chunks_of(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
        """Numbers of the stored chunks of `key` that the region (offsets, shape) intersects."""
        if key not in self._chunk_index:
            index = RegionIndex()
            for n, chunk in enumerate(self.metadata.state_dict_metadata[key].chunks):
                index.add(chunk.offsets, chunk.sizes, n)
            self._chunk_index[key] = index
        return sorted(self._chunk_index[key].intersecting(offsets, shape))

    def read_region(
        self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...], into: np.ndarray | None = None
    ) -> np.ndarray:
        """The region (offsets, shape) of the tensor `key`, assembled from the stored chunks it intersects,
        in the start of `into` (a uint8 array of at least its bytes, to reuse memory) or fresh memory.

        A chunk stored as torch.save writes a plain tensor (one little-endian record, the chunk's bytes in
        order), or as raw bytes, is read straight from its record, only the bytes the region needs, and where
        the region's part is contiguous, straight into its place. Other chunks are loaded whole through the
        unpickler."""
        dtype = self.dtypes[key]
        nbytes = math.prod(shape) * dtype.itemsize
        fits = into is not None and into.size >= nbytes
        out = (into if fits else np.empty(nbytes, dtype=np.uint8))[:nbytes].view(dtype).reshape(shape)
        covered = 0
        for n in self.chunks_of(key, offsets, shape):
            chunk_meta = self.metadata.state_dict_metadata[key].chunks[n]
            within_chunk, within_out = region_overlap(chunk_meta.offsets, chunk_meta.sizes, offsets, shape)
            target = out[within_out]
            record = self._raw_record(key, n)
            if record is None:
                np.copyto(target, self._load_chunk(key, n)[within_chunk], casting="unsafe")
            else:
                self._read_raw(key, n, record, within_chunk, target)
            covered += target.size
        if covered != out.size:
            raise ConversionError(f"{self.directory}: the stored chunks of '{key}' cover {covered} of the {out.size} elements at {list(offsets)}")
        return out

    def byte_span(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Path, int] | None:
        """(file, position) where the region's bytes lie in order, when one plainly stored chunk holds all of
        them contiguously (a layer's or expert's chunk at TP 1, a column-parallel one): they can be copied
        file to file without passing through memory."""
        hit = self.chunks_of(key, offsets, shape)
        if len(hit) != 1 or (record := self._raw_record(key, hit[0])) is None:
            return None
        chunk = self.metadata.state_dict_metadata[key].chunks[hit[0]]
        within, _ = region_overlap(chunk.offsets, chunk.sizes, offsets, shape)
        strides = contiguous_strides(chunk.sizes)
        first = sum(s.start * stride for s, stride in zip(within, strides))
        last = sum((s.stop - 1) * stride for s, stride in zip(within, strides))
        if tuple(s.stop - s.start for s in within) != tuple(shape) or last - first + 1 != math.prod(shape):
            return None
        info = self._storage(key, chunk.offsets)
        return self.directory / info.relative_path, record + first * self.dtypes[key].itemsize

    def _staging(self, nbytes: int) -> np.ndarray:
        """This thread's memory for the bytes of a part that is not contiguous in its region (a row-parallel
        chunk), reused from read to read: fresh memory would cost a page fault and a zeroing per 4 KiB."""
        staging = getattr(self._threads, "staging", None)
        if staging is None or staging.size < nbytes:
            staging = self._threads.staging = np.empty(nbytes, dtype=np.uint8)
        return staging[:nbytes]

    def _raw_record(self, key: str, number: int) -> int | None:
        """Where in its data file the bytes of chunk `number` of `key` start, when torch.save stored it as a
        plain tensor (dtype as declared, whole storage in order, little-endian), or when its record is the chunk's
        raw bytes (DCP's safetensors serialization: no archive, exactly the chunk's length); else None."""
        if (key, number) in self._records:
            return self._records[key, number]
        chunk = self.metadata.state_dict_metadata[key].chunks[number]
        info = self._storage(key, chunk.offsets)
        path = self.directory / info.relative_path
        record = None
        expected = math.prod(chunk.sizes) * self.dtypes[key].itemsize
        with open(path, "rb", buffering=0) as f:
            entries = record_entries(f, info.offset, info.length)
            if not entries and info.length == expected:
                record = info.offset
            data = [name for name in entries if name.startswith("data/")]
            pickled, byteorder = entries.get("data.pkl"), entries.get("byteorder")
            if len(data) == 1 and pickled is not None and all(i.compress_type == zipfile.ZIP_STORED for i in entries.values()):
                layout = saved_tensor_layout(member(f, info.offset, pickled))
                order = member(f, info.offset, byteorder) if byteorder is not None else b"little"
                record_info = entries[data[0]]
                if (
                    layout == (data[0].split("/", 1)[1], self.dtypes[key], 0, tuple(chunk.sizes), contiguous_strides(chunk.sizes))
                    and record_info.file_size == expected
                    and order == b"little"
                ):
                    record = member_start(f, info.offset, record_info)
        self._records[key, number] = record
        return record

    def _read_raw(self, key: str, number: int, record: int, within: tuple[slice, ...], target: np.ndarray) -> None:
        """Read the part `within` of a raw chunk into `target`: the span of bytes from its first element to
        its last, straight into `target` when that span is exactly the part and `target` is contiguous."""
        chunk = self.metadata.state_dict_metadata[key].chunks[number]
        info = self._storage(key, chunk.offsets)
        strides = contiguous_strides(chunk.sizes)
        first = sum(s.start * stride for s, stride in zip(within, strides))
        last = sum((s.stop - 1) * stride for s, stride in zip(within, strides))
        itemsize = target.dtype.itemsize
        span = last - first + 1
        direct = span == target.size and target.flags.c_contiguous
        buffer = target.reshape(-1) if direct else self._staging(span * itemsize).view(target.dtype)
        view = memoryview(buffer.view(np.uint8))
        path = self.directory / info.relative_path
        with open(path, "rb", buffering=0) as f:
            position, done = record + first * itemsize, 0
            while done < len(view):  # one read returns at most 2 GiB
                count = os.preadv(f.fileno(), [view[done:]], position + done)
                if not count:
                    raise ConversionError(f"{path}: truncated while reading chunk {number} of '{key}'")
                done += count
        if not direct:
            sizes = tuple(s.stop - s.start for s in within)
            np.copyto(target, strided(buffer, sizes, tuple(s * itemsize for s in strides)))


class RegionIndex:
    """Items that each hold a region (offsets, sizes) of one tensor, found by the regions they intersect.

    Regions one element thick along their first axes (a layer's, or a layer's expert's, of a stacked tensor)
    are filed by their offsets along those axes, so that a lookup tests the regions of its own layer and expert
    only: a MoE layer's tensor has hundreds of expert regions, and testing them all made lookups quadratic."""

    def __init__(self) -> None:
        # By the count of leading axes of size 1, then by the offsets along them.
        self._filed: dict[int, dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], Any]]]] = {}

    def add(self, offsets, sizes, item: Any) -> None:
        depth = next((axis for axis, size in enumerate(sizes) if size != 1), len(sizes))
        self._filed.setdefault(depth, {}).setdefault(tuple(offsets[:depth]), []).append((tuple(offsets), tuple(sizes), item))

    def intersecting(self, offsets, shape) -> list[Any]:
        """The items whose regions share elements with the region (offsets, shape)."""
        found = []
        for depth, by_offsets in self._filed.items():
            ranges = [range(o, o + n) for o, n in zip(offsets[:depth], shape[:depth])]
            if math.prod(map(len, ranges)) <= len(by_offsets):
                candidates = [entry for at in itertools.product(*ranges) for entry in by_offsets.get(at, ())]
            else:
                candidates = [entry for entries in by_offsets.values() for entry in entries]
            found += [item for at, sizes, item in candidates if region_overlap(at, sizes, offsets, shape) is not None]
        return found


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


