"""The safetensors format, knowing nothing of models: a file is an 8-byte little-endian header length, a JSON
header (name -> dtype, shape, data_offsets) and the raw bytes; a sharded checkpoint adds an index of tensor ->
file. Headers are read and checked without reading data; `SafetensorsWriter` writes sharded files as the
tensors come, from any thread or process, at places computed before the first byte."""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.formats.copying import copy_range

# The safetensors library's own limit on a header (its MAX_HEADER_SIZE).
SAFETENSORS_HEADER_BYTES = 100 * 10**6
ST_DTYPES = {
    name: dtypes.BY_NAME[torch_name]
    for name, torch_name in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
        # Power-of-two scales (DeepSeek-V3.2's `scale_fmt: ue8m0` block scales may be stored so).
        ("F8_E8M0", "float8_e8m0fnu"),
    )
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Rows:
    """Some rows of a tensor whose rows fall in `groups` equal groups: rows [start, stop) of every group, in
    group order. One section of a fused projection, whose sections may interleave group by group."""

    groups: int
    start: int
    stop: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.groups * (self.stop - self.start), *shape[1:])

    def select(self, tensor: np.ndarray) -> np.ndarray:
        grouped = tensor.reshape(self.groups, -1, *tensor.shape[1:])
        return grouped[:, self.start : self.stop].reshape(self.shape(tuple(tensor.shape)))

    def runs(self, shape: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
        """(first byte, length) of each group's rows within the tensor's bytes, in order."""
        row = math.prod(shape[1:]) * itemsize
        group = shape[0] // self.groups * row
        return [(g * group + self.start * row, (self.stop - self.start) * row) for g in range(self.groups)]


# A part of a tensor that the readers and writers take: one slice of its first axis, or some of its rows.
Part = int | Rows | None


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ConversionError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise ConversionError(f"{path}: truncated (header of {header_len} bytes, file of {size})")
        if header_len > SAFETENSORS_HEADER_BYTES:
            raise ConversionError(f"{path}: a header of {header_len} bytes, over the safetensors limit of {SAFETENSORS_HEADER_BYTES}")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, RecursionError) as e:
            raise ConversionError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: unreadable safetensors header (a JSON {type(header).__name__}, not an object of tensors)")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, (begin, end), shape = info["dtype"], info["data_offsets"], tuple(int(n) for n in info["shape"])
            if not all(type(n) is int for n in (begin, end)):
                raise TypeError("offsets that are not integers")
        except (TypeError, KeyError, ValueError):
            raise ConversionError(f"{path}: tensor '{name}' has a malformed header entry {info!r}") from None
        if dtype_name not in ST_DTYPES:
            raise ConversionError(f"{path}: tensor '{name}' has unsupported dtype {dtype_name}")
        dtype = ST_DTYPES[dtype_name]
        if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise ConversionError(f"{path}: tensor '{name}' has data_offsets [{begin}, {end}] for shape {list(shape)} of {dtype_name}")
        if base + end > size:
            raise ConversionError(f"{path}: truncated (tensor '{name}' ends at byte {base + end}, file has {size})")
        tensors[name] = StoredTensor(path, dtype, shape, base + begin, base + end)
    return tensors


_ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}


def parse_size(text: str) -> int:
    """Bytes in a size such as transformers' max_shard_size: "5GB" (10^9), "500MiB" (2^20), or a plain number."""
    value = text.strip().upper()
    for unit, factor in _SIZE_UNITS.items():
        if value.endswith(unit):
            value, multiplier = value[: -len(unit)], factor
            break
    else:
        multiplier = 1
    try:
        size = int(float(value) * multiplier)
    except ValueError:
        raise ConversionError(f"size '{text}' is not a number of bytes with an optional unit (5GB, 500MiB)") from None
    if size <= 0:
        raise ConversionError(f"size '{text}' must be positive")
    return size


class SafetensorsWriter:
    """Sharded safetensors files written as the tensors come, in any order, from any thread, with bounded
    memory.

    The layout of every file (which tensors, their headers and byte offsets) is computed from the tensors'
    names, dtypes and shapes before any data exists, the same in every process; the process that `create`s
    writes the headers and sizes the files, and then each tensor (or each slice of its first axis) is written
    at its place, by whichever thread or process converts it. `finish` checks that every byte was written
    and writes the index.
    """

    def __init__(
        self,
        directory: Path,
        tensors: dict[str, tuple[Any, tuple[int, ...]]],
        max_shard_size: int,
        create: bool = True,
        together: list[list[str]] | None = None,
    ):
        self.directory = directory
        # Files break between the groups of `together` (every tensor, in their order; default: one group
        # each): a file holds whole groups.
        groups: list[list[str]] = [[]]
        group_bytes = 0
        for names in together if together is not None else [[name] for name in tensors]:
            size = sum(math.prod(tensors[name][1]) * tensors[name][0].itemsize for name in names)
            if groups[-1] and group_bytes + size > max_shard_size:
                groups.append([])
                group_bytes = 0
            groups[-1].extend(names)
            group_bytes += size
        tensors = {name: (dtypes.dtype_of(dtype), shape) for name, (dtype, shape) in tensors.items()}
        self.places: dict[str, tuple[Path, int, np.dtype, tuple[int, ...]]] = {}
        self.weight_map: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.written: dict[str, int] = {}  # bytes written by this process, by tensor
        self.files: dict[Path, list[str]] = {}  # each file's tensors, in their order there
        # Per file: how many of its tensors, from the first, this process wrote in full, and where they end.
        self._prefix: dict[Path, tuple[int, int]] = {}
        self.total_bytes = 0
        for number, names in enumerate(groups, 1):
            file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                dtype, shape = tensors[name]
                size = math.prod(shape) * dtype.itemsize
                header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
                offset += size
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # tensors start 8-byte aligned, as the safetensors library writes
            path = directory / file
            if create:
                with open(path, "wb") as f:
                    f.write(struct.pack("<Q", len(encoded)) + encoded)
                    f.truncate(8 + len(encoded) + offset)
            base = 8 + len(encoded)
            self.files[path], self._prefix[path] = names, (0, base)
            for name in names:
                dtype, shape = tensors[name]
                self.places[name] = (path, base + header[name]["data_offsets"][0], dtype, tuple(shape))
                self.weight_map[name] = file
                self.sizes[name] = math.prod(shape) * dtype.itemsize
                self.written[name] = 0
            self.total_bytes += offset
        self._files: dict[tuple[Path, int], int] = {}  # (path, open flags) -> descriptor
        self._lock = threading.Lock()

    def _fd(self, path: Path, flags: int = os.O_WRONLY) -> int:
        """The file opened once for all threads (written to and read from only at given offsets)."""
        with self._lock:
            if (path, flags) not in self._files:
                self._files[path, flags] = os.open(path, flags)
            return self._files[path, flags]

    def written_prefix(self, path: Path) -> int:
        """How many bytes from the start of file `path` are in place: its header, then its tensors in order up
        to the first that this process has not written in full (what other processes wrote is not counted)."""
        with self._lock:
            count, end = self._prefix[path]
            names = self.files[path]
            while count < len(names) and self.written[names[count]] == self.sizes[names[count]]:
                end = self.places[names[count]][1] + self.sizes[names[count]]
                count += 1
            self._prefix[path] = count, end
            return end

    def nbytes(self, name: str, index: Part = None) -> int:
        """The bytes of tensor `name`, or of its part `index` (a slice along the first axis, or some rows)."""
        _, _, dtype, shape = self.places[name]
        if isinstance(index, Rows):
            return math.prod(index.shape(shape)) * dtype.itemsize
        return self.sizes[name] // shape[0] if index is not None else self.sizes[name]

    def write(self, name: str, tensor: Any, index: Part = None) -> None:
        """Write tensor `name` (a numpy array or a CPU torch tensor), or its part `index` (a slice along the first
        axis, or some rows)."""
        path, begin, dtype, shape = self.places[name]
        runs = [(0, None)]
        if isinstance(index, Rows):
            runs, shape = index.runs(shape, dtype.itemsize), index.shape(shape)
        elif index is not None:
            begin += index * math.prod(shape[1:]) * dtype.itemsize
            shape = shape[1:]
        array = dtypes.as_numpy(tensor)
        if array.dtype != dtype or tuple(array.shape) != shape:
            raise AssertionError(f"'{name}': got {array.dtype} {list(array.shape)}, the layout says {dtype} {list(shape)}")
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        fd, taken = self._fd(path), 0
        for at, length in runs:
            run = data[taken : taken + length if length is not None else len(data)]
            done = 0
            while done < len(run):  # one write takes at most 2 GiB
                done += os.pwrite(fd, run[done:], begin + at + done)
            taken += len(run)
        with self._lock:
            self.written[name] += len(data)

    def copy(self, name: str, index: int | None, source: Path, position: int) -> None:  # never some Rows
        """Write tensor `name` (or its slice `index`) as the bytes at `position` of file `source`, copied by
        the kernel where it can (`copy_range`), as `cp` copies: its layout's dtype and shape, in order."""
        path, begin, dtype, shape = self.places[name]
        if index is not None:
            begin += index * math.prod(shape[1:]) * dtype.itemsize
            shape = shape[1:]
        length = math.prod(shape) * dtype.itemsize
        copy_range(self._fd(source, os.O_RDONLY), position, self._fd(path), begin, length, source, f"tensor '{name}'")
        with self._lock:
            self.written[name] += length

    def finish(self, written: list[dict[str, int]] | None = None) -> None:
        """Check that every byte was written (by this process, or by all of `written`, each process's
        `written`) and write the index."""
        self.close()
        written = written if written is not None else [self.written]
        unwritten = [name for name, size in self.sizes.items() if sum(part[name] for part in written) != size]
        if unwritten:
            raise AssertionError(f"{len(unwritten)} tensors not (fully) written, e.g. '{unwritten[0]}'")
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()
