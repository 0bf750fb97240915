"""`.metadata` of a `torch_dist` checkpoint, made from what every rank wrote (`WrittenPart`) by torch's
own DCP classes and global save planning, so that any DCP reader (megatron-core's included) reads it.

Importing torch's DCP package took 1.3-1.7 s beside the writing on the 2-core box and 3.8-10.4 s on the 16-core
GPU hosts (CUDA torch), holding the interpreter's lock through most of it (it pulls in DTensor and sympy). It is
imported beside the writing: on a thread of the conversion, or, for a large conversion on a host with cores to
spare, in a helper process forked as the writing starts, which waits for the records. On the GPU hosts the
thread stalled the copies of a mixture-of-experts model's small tensors while it ran, and the helper saved
1.1-1.6 s of 15.5 at one worker and 5.6-6.6 s of 16.4-17.4 at eight; on the 2-core box it takes a core the
writing needs and cost about 0.7 s (docs/history.md, "The DCP import in a forked helper")."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

Shape = tuple[int, ...]
# Where an item is stored: (data file name, offset, length), as DCP's filesystem storage records it.
Place = tuple[str, int, int]


@dataclass
class WrittenPart:
    """What one rank wrote: each chunk (key, global offsets, shape) and each object (key), with its place."""

    chunks: list[tuple[str, Shape, Shape, Place]]
    objects: list[tuple[str, Place]]


# A conversion gets the helper process from these bytes written (at about 1 GB/s they take as long as the import)
# on a host with this many cores for it (measured: 2 too few, 16 enough; 4 leaves one beside a worker's loading,
# writing and hashing threads).
HELPER_BYTES = 10**9
HELPER_CORES = 4


def helper_pays(nbytes: int) -> bool:
    return nbytes >= HELPER_BYTES and len(os.sched_getaffinity(0)) >= HELPER_CORES


def write_metadata(directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> None:
    """`.metadata` from what every rank wrote, merged by torch's global save planning, once the chunks cover
    every declared tensor exactly."""
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    properties = {key: (TensorProperties(dtype=dtype), torch.Size(size)) for key, (dtype, size) in declared.items()}
    plans, stored = [], {}
    for part in parts:
        items = []
        for key, offsets, shape, place in part.chunks:
            index = MetadataIndex(key, torch.Size(offsets))
            chunk = ChunkStorageMetadata(index.offset, torch.Size(shape))
            items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=TensorWriteData(chunk, *properties[key])))
            stored[index] = _StorageInfo(*place)
        for key, place in part.objects:
            index = MetadataIndex(key)
            items.append(WriteItem(index, WriteItemType.BYTE_IO))
            stored[index] = _StorageInfo(*place)
        plans.append(SavePlan(items))
    plans, metadata = create_default_global_save_plan(plans)
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


class MetadataMaker:
    """Makes `.metadata` (`make`), importing torch's DCP package from now on: on a thread, or with `helper`, in a
    process forked now, which has torch imported already. Made before any other thread of the conversion starts
    and before the output directory is locked (a helper inherits open files). Used as a context manager, it ends
    a helper that has not made it (the conversion failed or was interrupted), and lets the thread's import finish
    (torch's extensions can end a process that exits in the middle of one with an abort); a helper whose parent
    dies reads the end of its input and ends without writing."""

    def __init__(self, helper: bool = False):
        self._pid = self._importing = None
        if not helper:
            self._importing = threading.Thread(target=_import_planning, kwargs={"quietly": True}, daemon=True)
            self._importing.start()
            return
        records_in, records_out = os.pipe()
        errors_in, errors_out = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:
            code = 1
            try:  # never back into the conversion's code: this process only makes `.metadata`, then ends
                os.close(records_out)
                os.close(errors_in)
                # Its own session: a terminal's Ctrl-C reaches the conversion, which ends the helper on its way
                # out, not the helper in the middle of an import.
                os.setsid()
                code = _helper(records_in, errors_out)
            finally:
                os._exit(code)
        os.close(records_in)
        os.close(errors_out)
        self._records: int | None = records_out
        self._errors = errors_in

    def make(self, directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> None:
        if self._importing is not None:
            self._importing.join()
            write_metadata(directory, parts, declared)
            return
        unsent = memoryview(pickle.dumps((directory, parts, declared)))
        with contextlib.suppress(BrokenPipeError):  # a helper that failed says why
            while unsent:
                unsent = unsent[os.write(self._records, unsent):]
        os.close(self._records)
        self._records = None
        error = b"".join(iter(lambda: os.read(self._errors, 1 << 16), b"")).decode(errors="replace").strip()
        _, status = os.waitpid(self._pid, 0)
        self._pid = None
        os.close(self._errors)
        if status != 0:
            raise RuntimeError(f"{directory / '.metadata'}: {error or f'the helper ended with status {status}'}")

    def close(self) -> None:
        if self._importing is not None:
            self._importing.join()
        if self._pid is not None:
            os.kill(self._pid, signal.SIGKILL)
            os.waitpid(self._pid, 0)
            self._pid = None
            if self._records is not None:
                os.close(self._records)
            os.close(self._errors)

    def __enter__(self) -> MetadataMaker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _import_planning(quietly: bool = False) -> None:
    """Import torch's DCP planning ahead of `write_metadata`, which imports it again where it is needed: a thread's
    failed import (`quietly`) is reported there, once, rather than as the thread's traceback as well."""
    try:
        import torch.distributed.checkpoint.default_planner  # noqa: F401
    except Exception:
        if not quietly:
            raise


def _helper(records_in: int, errors_out: int) -> int:
    """The helper: import what `write_metadata` needs, then make `.metadata` from the records that come; nothing
    when the input ends first (the conversion did not finish). Its exit code; an error in one line."""
    try:
        _import_planning()
        with open(records_in, "rb") as records:
            received = records.read()
        if received:
            write_metadata(*pickle.loads(received))
        return 0
    except BaseException as error:
        os.write(errors_out, f"{type(error).__name__}: {error}".encode())
        return 1
