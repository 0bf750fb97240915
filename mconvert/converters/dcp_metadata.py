"""`.metadata` of a `torch_dist` checkpoint, made from what every rank wrote (`dcp_writer.WrittenPart`) by torch's
own DCP classes and global save planning, so that any DCP reader (megatron-core's included) reads it.

Importing torch's DCP package takes about a second on one core, seconds on some hosts (it pulls in DTensor and
sympy), and holds the interpreter's lock through most of it: on a thread beside the writing, it cut the copies
of a mixture-of-experts model's small tensors from hundreds a second to a few while it ran (docs/performance.md,
"The way in at one worker on a 16-core host"). A conversion that writes enough to hide a process's start makes
`.metadata` in a helper process (this module run as a program), started with the writing, which imports the
package on another core and waits for the records; a smaller one imports it when `.metadata` is due."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mconvert.converters.dcp_writer import Shape, WrittenPart

# Bytes written from which the helper process pays: writing them at about 1 GB/s takes about as long as its start
# (the interpreter and torch's import, then the DCP package's).
BESIDE_BYTES = 10**9
_ROOT = str(Path(__file__).resolve().parents[2])  # where the helper finds this package


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
    """Makes `.metadata` (`make`): in this process, or with `beside`, in a helper process started now. Used as a
    context manager, it ends a helper that has not made it (the conversion failed or was interrupted); a helper
    whose parent dies reads the end of its input and ends without writing."""

    def __init__(self, beside: bool = False):
        self._helper = None
        if beside:
            # Its own session: a terminal's Ctrl-C reaches the conversion, which ends the helper on its way out,
            # not the helper in the middle of an import (torch's extensions can end that with an abort).
            self._helper = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))},
                start_new_session=True,
            )

    def make(self, directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> None:
        if self._helper is None:
            write_metadata(directory, parts, declared)
            return
        _, error = self._helper.communicate(pickle.dumps((directory, parts, declared)))
        if self._helper.returncode != 0:
            lines = error.decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"{directory / '.metadata'}: {lines[-1] if lines else f'exit code {self._helper.returncode}'}")

    def close(self) -> None:
        if self._helper is not None and self._helper.poll() is None:
            self._helper.kill()
            self._helper.communicate()

    def __enter__(self) -> MetadataMaker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def main() -> int:
    """The helper: import what `write_metadata` needs while the conversion writes, then make `.metadata` from the
    records on stdin; nothing when stdin ends first (the conversion did not finish)."""
    import torch.distributed.checkpoint.default_planner  # noqa: F401

    received = sys.stdin.buffer.read()
    if not received:
        return 0
    try:
        write_metadata(*pickle.loads(received))
    except Exception as error:  # the parent reports it, in one line
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
