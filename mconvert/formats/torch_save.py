"""torch.save's archive format, read without torch.load: a record's zip members found through its central
directory, where a member's bytes start, and a saved tensor's layout read from its small pickle without
running it, so that a plainly stored tensor's bytes can be read in place or copied file to file."""

from __future__ import annotations

import io
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch


class FileWindow(io.RawIOBase):
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


# Read size of zipfile's reads of a torch.save archive's end: its central directory (a few entries).
_ZIP_READ = 1 << 16
_ZIP_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


def record_entries(f, offset: int, length: int) -> dict[str, zipfile.ZipInfo]:
    """The members of the torch.save record at [offset, offset + length) of file `f`, by name within its
    archive folder; none if it is not a zip archive."""
    # zipfile reads the record's end and central directory through a window of just this record, so that the
    # offsets in them are the record's own (the GPU machine's Python 3.12.3 rejects a zip64 end record whose
    # offsets point outside what it was given, as they would in a tail of the record).
    try:
        with zipfile.ZipFile(io.BufferedReader(FileWindow(f, offset, length), buffer_size=_ZIP_READ)) as archive:
            return {i.filename.split("/", 1)[-1]: i for i in archive.infolist()}
    except (zipfile.BadZipFile, ValueError):
        return {}


def tensor_data_start(path: Path, offset: int, length: int) -> int:
    """Where the storage bytes of the tensor that torch.save wrote at [offset, offset + length) of `path`
    begin, counted from `offset`."""
    with open(path, "rb", buffering=0) as f:
        entries = record_entries(f, offset, length)
        (data,) = [entry for name, entry in entries.items() if name.startswith("data/")]
        return member_start(f, offset, data) - offset


def member_start(f, archive: int, entry: zipfile.ZipInfo) -> int:
    """Absolute position in file `f` of the data of a stored (uncompressed) zip entry of the archive that
    starts at `archive`."""
    header = os.pread(f.fileno(), _ZIP_LOCAL_HEADER.size, archive + entry.header_offset)
    fields = _ZIP_LOCAL_HEADER.unpack(header)
    name_length, extra_length = fields[-2], fields[-1]
    return archive + entry.header_offset + _ZIP_LOCAL_HEADER.size + name_length + extra_length


def member(f, archive: int, entry: zipfile.ZipInfo) -> bytes:
    return os.pread(f.fileno(), entry.file_size, member_start(f, archive, entry))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a torch.save'd tensor's pickle only for where its data is: (record, dtype, storage offset,
    size, stride); anything but a plain tensor gives None."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def saved_tensor_layout(pickled: bytes) -> tuple | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the typed storage classes' deprecation
            storage, offset, size, stride = _LayoutUnpickler(io.BytesIO(pickled)).load()
            _, storage_type, record, _, _ = storage
            return record, getattr(torch, storage_type).dtype, offset, size, stride
    except (pickle.UnpicklingError, TypeError, ValueError, EOFError, AttributeError):
        return None


def contiguous_strides(sizes) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(sizes)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


