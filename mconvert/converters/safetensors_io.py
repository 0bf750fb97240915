"""HF safetensors checkpoints: a lazy reader that reads one tensor (or one slice of its first axis) at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets) and
the raw bytes. Reading with plain file reads into a fresh buffer, rather than through a memory map, keeps the
process's resident memory at the tensors in hand, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mconvert.errors import ConversionError

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: torch.dtype
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
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise ConversionError(f"{path}: unreadable safetensors header ({e})") from None
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in ST_DTYPES:
            raise ConversionError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype, shape = ST_DTYPES[info["dtype"]], tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ConversionError(f"{path}: tensor '{name}' has {end - begin} bytes for shape {list(shape)}")
        if base + end > size:
            raise ConversionError(f"{path}: truncated (tensor '{name}' ends at byte {base + end}, file has {size})")
        tensors[name] = StoredTensor(path, dtype, shape, base + begin, base + end)
    return tensors


class HFCheckpoint:
    """The tensors of an HF checkpoint directory: `model.safetensors`, or shards listed by the index."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_FILE).exists():
            weight_map, files = {}, [SINGLE_FILE]
        else:
            files, weight_map = sorted(p.name for p in self.directory.glob("*.safetensors")), {}
            if not files:
                raise ConversionError(f"{self.directory}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files")
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            path = self.directory / file
            if not path.exists():
                raise ConversionError(f"{path}: shard named in {INDEX_FILE} is missing")
            for name, stored in read_header(path).items():
                if name in self.tensors:
                    raise ConversionError(f"{path}: tensor '{name}' is also in {self.tensors[name].file.name}")
                self.tensors[name] = stored
        for name, file in weight_map.items():
            if name not in self.tensors or self.tensors[name].file.name != file:
                raise ConversionError(f"{self.directory / file}: tensor '{name}' listed in {INDEX_FILE} is not there")

    def where(self, name: str) -> str:
        return f"tensor '{name}' in {self.tensors[name].file}"

    def _region(self, name: str, index: int | None) -> tuple[StoredTensor, int, tuple[int, ...], int]:
        """Where the tensor `name` (or its slice `index`) is: its file's entry, first byte, shape and length."""
        stored = self.tensors[name]
        begin, shape = stored.begin, stored.shape
        if index is not None:
            row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
            begin, shape = begin + index * row_bytes, shape[1:]
        return stored, begin, shape, math.prod(shape) * stored.dtype.itemsize

    def nbytes(self, name: str, index: int | None = None) -> int:
        return self._region(name, index)[3]

    def read(self, name: str, index: int | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name`, or its slice `index` along the first axis (one expert of a fused expert tensor),
        read into the start of `into` (a uint8 tensor of at least its bytes, to reuse memory) or fresh memory."""
        stored, begin, shape, length = self._region(name, index)
        # torch.empty, unlike bytearray, does not spend a pass zero-filling what the read overwrites.
        buffer = (torch.empty(length, dtype=torch.uint8) if into is None else into)[:length]
        view = memoryview(buffer.numpy())
        with open(stored.file, "rb", buffering=0) as f:
            f.seek(begin)
            done = 0
            while done < length:  # one read() returns at most 2 GiB
                count = f.readinto(view[done:])
                if not count:
                    raise ConversionError(f"{stored.file}: truncated while reading tensor '{name}'")
                done += count
        return buffer.view(stored.dtype).reshape(shape)
