"""torch.save's archive format, read without torch.load and written without torch.save. Read: a record's zip members
found through its central directory, where a member's bytes start, and a saved tensor's layout read from its small
pickle without running it, so that a plainly stored tensor's bytes can be read in place or copied file to file.
Written: the archive around a pickle and its storages, as torch.save lays it out (its zip writer's members, 64-byte
aligned storages, zip64 fields past 4 GiB, no CRC32s, as with torch's `save.compute_crc32` off), so that a
conversion writes the records torch.load reads without importing torch."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mconvert import dtypes
from mconvert.formats.pickle_writer import Call, Global, Persistent, dumps


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
        if module == "torch" and name.endswith("Storage"):
            return name  # a storage class's name: torch's class gives the dtype (saved_tensor_layout)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def saved_tensor_layout(pickled: bytes) -> tuple | None:
    """Where a torch.save'd tensor's data is, from its pickle: (record, dtype, storage offset, size, stride); None for
    anything but a plain tensor of a typed storage that a conversion moves."""
    try:
        storage, offset, size, stride = _LayoutUnpickler(io.BytesIO(pickled)).load()
        _, storage_type, record, _, _ = storage
        return record, _STORAGE_DTYPES[storage_type], offset, size, stride
    except (pickle.UnpicklingError, TypeError, ValueError, EOFError, KeyError):
        return None


def contiguous_strides(sizes) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(sizes)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# torch.save's storage class of each dtype that a conversion writes, by torch's name (float8 weights are written
# dequantized; torch.save pickles float8 tensors another way).
STORAGE_CLASSES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage",
}
_STORAGE_DTYPES = {name: dtypes.BY_NAME[dtype] for dtype, name in STORAGE_CLASSES.items()}
# torch.save's zip writer (miniz, as torch drives it): members in this order around the storages, each local header
# without sizes or CRC32 (a data descriptor follows its bytes), its bytes aligned to 64 by an "FB" extra field; zip64
# fields where a size or a place reaches 4 GiB, and zip64 end records always. The storages' CRC32s are 0 (their bytes
# are written or copied in later; torch.load does not check them), the small members' their own.
_MEMBERS_BEFORE = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_MEMBERS_AFTER = (("version", b"3\n"), (".data/serialization_id", b"0" * 40))
_ALIGNMENT, _ZIP64 = 64, 0xFFFFFFFF
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")


class _Archive:
    """A torch.save archive's bytes, written member by member; a storage's bytes are left out (a hole of its size),
    so that the bytes between them come out as segments."""

    def __init__(self, folder: str):
        self.folder, self.cursor = folder, 0
        self.segments: list[bytes] = []
        self._out = bytearray()
        self._members: list[tuple[bytes, int, int, int]] = []  # (name, header offset, size, CRC32)

    def member(self, name: str, data: bytes | None, size: int) -> None:
        encoded, offset = f"{self.folder}/{name}".encode(), self.cursor
        fields = (struct.pack("<QQ", size, 0) if size >= _ZIP64 else b"") + (struct.pack("<Q", offset) if offset >= _ZIP64 else b"")
        zip64 = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
        padding = -(offset + _ZIP_LOCAL_HEADER.size + len(encoded) + len(zip64) + 4) % _ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        header = _ZIP_LOCAL_HEADER.pack(0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, 0, len(encoded), len(extra))
        crc = zlib.crc32(data) if data is not None else 0
        self._members.append((encoded, offset, size, crc))
        self._write(header + encoded + extra)
        if data is None:
            self.segments.append(bytes(self._out))
            self._out.clear()
            self.cursor += size
        else:
            self._write(data)
        wide = size >= _ZIP64 or offset >= _ZIP64
        self._write(struct.pack("<IIQQ" if wide else "<IIII", 0x08074B50, crc, size, size))

    def _write(self, data: bytes) -> None:
        self._out += data
        self.cursor += len(data)

    def end(self) -> list[bytes]:
        """The central directory and end records; the segments around the storages."""
        start, entries = self.cursor, len(self._members)
        for encoded, offset, size, crc in self._members:
            fields = (struct.pack("<QQ", size, size) if size >= _ZIP64 else b"") + (struct.pack("<Q", offset) if offset >= _ZIP64 else b"")
            extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
            stored, place = min(size, _ZIP64), min(offset, _ZIP64)
            self._write(_CENTRAL.pack(0x02014B50, 0, 0, 0x0808, 0, 0, 0, crc, stored, stored, len(encoded), len(extra), 0, 0, 0, 0, place) + encoded + extra)
        length, zip64_end = self.cursor - start, self.cursor
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, entries, entries, length, start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, entries, entries, length, min(start, _ZIP64), 0))
        return [*self.segments, bytes(self._out)]


def saved_segments(pickled: bytes, storage_sizes: Sequence[int], folder: str = "archive") -> list[bytes]:
    """torch.save's record of the pickle `pickled`, whose persistent ids name storages "0", "1", ... of these byte
    sizes, as the bytes before, between and after the storages' bytes (one segment more than storages)."""
    archive = _Archive(folder)
    archive.member("data.pkl", pickled, len(pickled))
    for name, data in _MEMBERS_BEFORE:
        archive.member(name, data, len(data))
    for number, size in enumerate(storage_sizes):
        archive.member(f"data/{number}", None, size)
    for name, data in _MEMBERS_AFTER:
        archive.member(name, data, len(data))
    return archive.end()


def tensor_pickle(dtype: np.dtype, shape: tuple[int, ...], storage: str = "0") -> Call:
    """What torch.save pickles for a whole contiguous CPU tensor of `dtype` and `shape` in storage `storage`."""
    location = Persistent(("storage", Global("torch", STORAGE_CLASSES[dtype.name]), storage, "cpu", math.prod(shape)))
    return Call(Global("torch._utils", "_rebuild_tensor_v2"),
                (location, 0, tuple(shape), contiguous_strides(shape), False, Call(Global("collections", "OrderedDict"), ())))


def tensor_record(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """torch.save's record of a tensor of `dtype` and `shape`: the bytes before its storage's bytes and after."""
    head, tail = saved_segments(dumps(tensor_pickle(dtype, shape)), [math.prod(shape) * dtype.itemsize])
    return head, tail


def saved_bytes(value: object, storages: Sequence[bytes] = (), folder: str = "archive") -> bytes:
    """torch.save's bytes of `value` (what mconvert.formats.pickle_writer.dumps takes, tensors as `tensor_pickle`s)
    with the bytes of its storages "0", "1", ..."""
    segments = saved_segments(dumps(value), [len(storage) for storage in storages], folder)
    return b"".join(part for pair in zip(segments, [*storages, b""]) for part in pair)
