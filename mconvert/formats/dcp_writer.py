"""Writing `torch_dist` checkpoints' DCP part (the directory: mconvert.mcore.checkpoint): the chunks streamed
into data files as they come, their places recorded as plain tuples, from which `.metadata` is made at the end
(mconvert.formats.dcp_metadata)."""

from __future__ import annotations

import functools
import io
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mconvert.dtypes import as_numpy, dtype_of
from mconvert.formats.copying import copy_range
from mconvert.formats.dcp_metadata import Place, Shape, WrittenPart, write_metadata
from mconvert.formats.torch_save import tensor_record

# Bytes of another file: (path, first byte, length).
Span = tuple[Path, int, int]


# Where a data file ends and the next begins: each is hashed on one core (about 1 GB/s) behind its writer, so
# that one writer's files, hashed side by side, keep up with it (2 GB/s and more) instead of one hash of all
# it writes holding the conversion's end back.
DATA_FILE_BYTES = 2 * 10**9


class DCPWriter:
    """Writes a DCP checkpoint's chunks as they come into data files of this rank (`__<rank>_<n>.distcp`: each
    writing thread, a stream, fills its own, one after another, of about DATA_FILE_BYTES each), and records
    their places, from which `finish` makes `.metadata`. `follow(path, written, closed)` is called for each data
    file as it is opened, to hash it while it is written: `written()` is how many bytes from its start are in
    place, and the event `closed` is set once the writer has gone on to its next file."""

    def __init__(
        self,
        directory: Path,
        streams: int = 1,
        rank: int = 0,
        follow: Callable[[Path, Callable[[], int], threading.Event], None] | None = None,
    ):
        self.directory = directory
        self._rank, self._follow = rank, follow
        self._lock = threading.Lock()
        self._names: list[str] = []
        # Each data file's bytes in place from its start (its records are complete up to there), and whether
        # its writer has gone on to another.
        self._complete: list[int] = []
        self._closed: list[threading.Event] = []
        self._files = [self._open() for _ in range(streams)]
        self._declared: dict[str, tuple[np.dtype, Shape]] = {}
        self._written = WrittenPart([], [])
        self._staging = [np.empty(0, dtype=np.uint8) for _ in range(streams)]
        self._sources: dict[Path, int] = {}
        # A tensor record's bytes before and after its storage bytes, by (dtype, shape): the same for the same
        # layout, made once.
        self._envelopes: dict[tuple[np.dtype, Shape], tuple[bytes, bytes]] = {}

    @property
    def data_files(self) -> list[Path]:
        return [self.directory / name for name in self._names]

    def _open(self) -> tuple[int, io.BufferedRandom]:
        with self._lock:
            number = len(self._names)
            self._names.append(f"__{self._rank}_{number}.distcp")
            self._complete.append(0)
            self._closed.append(threading.Event())
            f = open(self.directory / self._names[number], "w+b")  # read back: `_record`
            if self._follow is not None:
                self._follow(self.directory / self._names[number], functools.partial(self._complete.__getitem__, number), self._closed[number])
        return number, f

    def _file(self, stream: int) -> tuple[int, io.BufferedRandom]:
        """The data file that `stream` writes its next record into: its current one, or a new one once that
        holds DATA_FILE_BYTES."""
        number, f = self._files[stream]
        if f.tell() >= DATA_FILE_BYTES:
            f.close()
            self._closed[number].set()
            self._files[stream] = number, f = self._open()
        return number, f

    def declare(self, key: str, shape: Shape, dtype: Any) -> None:
        self._declared[key] = (dtype_of(dtype), tuple(shape))

    def _append(self, stream: int, payload: bytes) -> Place:
        number, f = self._file(stream)
        offset = f.tell()
        f.write(payload)
        f.flush()
        self._complete[number] = f.tell()
        return self._names[number], offset, f.tell() - offset

    def _record(self, stream: int, dtype: np.dtype, shape: Shape, data: np.ndarray | None) -> tuple[int, io.BufferedRandom, int, int]:
        """Write torch.save's record of a tensor of `dtype` and `shape` into a data file of `stream`, with the
        storage bytes of `data`, or with a hole where they go (to be copied in); return the file's number, the
        file, the record's start and where its storage bytes go."""
        number, f = self._file(stream)
        start = f.tell()
        envelope = self._envelopes.get((dtype, shape))
        if envelope is None:
            envelope = self._envelopes[dtype, shape] = tensor_record(dtype, shape)
        f.write(envelope[0])
        if data is None:
            f.seek(math.prod(shape) * dtype.itemsize, os.SEEK_CUR)
        else:
            f.write(data.reshape(-1).view(np.uint8).data)  # a contiguous slice's own bytes
        f.write(envelope[1])
        f.flush()
        return number, f, start, start + len(envelope[0])

    def write_chunk(self, key: str, offsets: Shape, chunk: Any, stream: int = 0) -> None:
        """Write a chunk (a numpy array, or a CPU torch tensor) of `key` at global `offsets` into a data file of
        `stream` (one per writing thread)."""
        dtype, size = self._declared[key]
        chunk = as_numpy(chunk)
        if chunk.dtype != dtype or len(offsets) != len(size):
            raise AssertionError(f"chunk of '{key}' at {offsets} does not fit {dtype} {list(size)}")
        # A layer's (or expert's) region of a stacked tensor is stored with its leading axes of size 1.
        chunk = chunk.reshape((1,) * (len(size) - chunk.ndim) + tuple(chunk.shape))
        if not chunk.flags.c_contiguous:  # a row-parallel chunk (TP > 1)
            chunk = self._staged(stream, chunk)
        number, f, start, _ = self._record(stream, dtype, tuple(chunk.shape), chunk)
        self._complete[number] = end = f.tell()
        self._written.chunks.append((key, tuple(offsets), tuple(chunk.shape), (self._names[number], start, end - start)))

    def copy_chunk(self, key: str, offsets: Shape, shape: Shape, spans: list[Span], stream: int = 0) -> None:
        """Write a chunk of `key` of `shape` at global `offsets` whose bytes are those of `spans`, in order (an
        HF tensor's stored bytes, or rows of them): the record is written without its storage bytes and the
        kernel copies them into place file to file (`copy_range`), as `cp` copies, instead of reading them into
        memory and writing them out again."""
        dtype, size = self._declared[key]
        shape = (1,) * (len(size) - len(shape)) + tuple(shape)
        if len(offsets) != len(size) or sum(length for _, _, length in spans) != math.prod(shape) * dtype.itemsize:
            raise AssertionError(f"chunk of '{key}' at {offsets} does not fit {dtype} {list(size)}")
        number, f, start, position = self._record(stream, dtype, shape, None)
        for path, begin, count in spans:
            copy_range(self._source(path), begin, f.fileno(), position, count, path, f"its bytes {begin}-{begin + count}")
            position += count
        self._complete[number] = end = f.tell()
        self._written.chunks.append((key, tuple(offsets), shape, (self._names[number], start, end - start)))

    def _source(self, path: Path) -> int:
        with self._lock:
            if path not in self._sources:
                self._sources[path] = os.open(path, os.O_RDONLY)
            return self._sources[path]

    def _staged(self, stream: int, chunk: np.ndarray) -> np.ndarray:
        """A contiguous copy of `chunk` in memory reused from chunk to chunk: fresh memory would cost the
        kernel a page fault and a zeroing per 4 KiB, more than the copy itself."""
        if self._staging[stream].size < chunk.nbytes:
            self._staging[stream] = np.empty(chunk.nbytes, dtype=np.uint8)
        staged = self._staging[stream][: chunk.nbytes].view(chunk.dtype).reshape(chunk.shape)
        np.copyto(staged, chunk)
        return staged

    def write_object(self, key: str, saved: bytes, stream: int = 0) -> None:
        """Write an object: `saved`, its torch.save bytes (mconvert.formats.torch_save.saved_bytes)."""
        self._written.objects.append((key, self._append(stream, saved)))

    def local_part(self) -> WrittenPart:
        """Close the data files; what this rank wrote, and where."""
        self.abort()
        return self._written

    def finish(self, parts: list[WrittenPart] | None = None) -> None:
        """Write `.metadata`: of what this writer wrote, or of every rank's `local_part` (`parts`)."""
        write_metadata(self.directory, parts if parts is not None else [self.local_part()], self._declared)

    def abort(self) -> None:
        for _, f in self._files:
            f.close()
        with self._lock:
            for fd in self._sources.values():
                os.close(fd)
            self._sources.clear()
