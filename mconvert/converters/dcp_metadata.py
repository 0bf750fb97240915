"""`.metadata` of a `torch_dist` checkpoint, made from what every rank wrote (`dcp_writer.WrittenPart`) by torch's
own DCP classes and global save planning, so that any DCP reader (megatron-core's included) reads it.

Importing torch's DCP package takes about a second on one core, seconds on some hosts (it pulls in DTensor and
sympy), and holds the interpreter's lock through most of it: on a thread beside the writing, it cut the copies
of a mixture-of-experts model's small tensors from hundreds a second to a few while it ran (docs/performance.md,
"The way in at one worker on a 16-core host"). A conversion that writes enough to hide the import makes
`.metadata` in a helper process forked as the writing starts, which imports the package on another core and
waits for the records; a smaller one imports it when `.metadata` is due."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mconvert.converters.dcp_writer import Shape, WrittenPart

# Bytes written from which the helper process pays: writing them at about 1 GB/s takes about as long as the DCP
# package's import.
BESIDE_BYTES = 10**9


def write_metadata(directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> None:
    """`.metadata` from what every rank wrote, merged by torch's global save planning, once the chunks cover
    every declared tensor exactly."""
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
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
    """Makes `.metadata` (`make`): in this process, or with `beside`, in a helper process forked now, which has
    torch imported already and imports the DCP package while this one writes. Made before any thread of the
    conversion starts and before the output directory is locked (the helper inherits open files). Used as a
    context manager, it ends a helper that has not made it (the conversion failed or was interrupted); a helper
    whose parent dies reads the end of its input and ends without writing."""

    def __init__(self, beside: bool = False):
        self._pid = None
        if not beside:
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
                # out, not the helper in the middle of an import (torch's extensions can end that with an abort).
                os.setsid()
                code = _helper(records_in, errors_out)
            finally:
                os._exit(code)
        os.close(records_in)
        os.close(errors_out)
        self._records: int | None = records_out
        self._errors = errors_in

    def make(self, directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> None:
        if self._pid is None:
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


def _helper(records_in: int, errors_out: int) -> int:
    """The helper: import what `write_metadata` needs, then make `.metadata` from the records that come; nothing
    when the input ends first (the conversion did not finish). Its exit code; an error in one line."""
    try:
        import torch.distributed.checkpoint.default_planner  # noqa: F401

        with open(records_in, "rb") as records:
            received = records.read()
        if received:
            write_metadata(*pickle.loads(received))
        return 0
    except BaseException as error:
        os.write(errors_out, f"{type(error).__name__}: {error}".encode())
        return 1
