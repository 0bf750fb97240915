"""`.metadata` of a `torch_dist` checkpoint, made from what every rank wrote (`WrittenPart`): the pickle of the
`Metadata` that torch's DCP writes (`create_default_global_save_plan` over every rank's plan), written opcode by
opcode, naming torch's classes without importing them. Any DCP reader (megatron-core's included) unpickles it into
torch's own classes; tests/test_dcp_metadata.py holds it equal to what torch's planner makes.

Importing torch's DCP package to build it took 1.3-1.7 s on the 2-core box and 3.8-10.4 s on the 16-core GPU hosts
(it pulls in DTensor and sympy), holding the interpreter's lock through most of it: a conversion of a small model
spent most of its time there (docs/history.md, "The DCP import in a forked helper")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mconvert.formats.pickle_writer import Call, Global, Instance, Pairs, dumps

Shape = tuple[int, ...]
# Where an item is stored: (data file name, offset, length), as DCP's filesystem storage records it.
Place = tuple[str, int, int]

METADATA = "torch.distributed.checkpoint.metadata"
VERSION = "1.0.0"  # Metadata.version as torch's DCP writes it


@dataclass
class WrittenPart:
    """What one rank wrote: each chunk (key, global offsets, shape) and each object (key), with its place."""

    chunks: list[tuple[str, Shape, Shape, Place]]
    objects: list[tuple[str, Place]]


def _size(shape: Shape) -> Call:
    return Call(Global("torch", "Size"), (tuple(shape),))


def _tensor_properties(dtype: np.dtype) -> Instance:
    """TensorProperties(dtype) with its defaults, in the tuple its __getstate__ gives: dtype, layout, requires_grad,
    memory format (as DCP encodes it), pin_memory."""
    layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Call(Global(METADATA, "_MEM_FORMAT_ENCODING"), (0,))
    return Instance(Global(METADATA, "TensorProperties"), (dtype, layout, False, contiguous, False))


def _index(key: str, offsets: Shape | None = None, number: int | None = None) -> Instance:
    return Instance(Global(METADATA, "MetadataIndex"), {"fqn": key, "offset": None if offsets is None else _size(offsets), "index": number})


def _storage(place: Place) -> Instance:
    path, offset, length = place
    return Instance(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     {"relative_path": path, "offset": offset, "length": length})


def metadata_state(parts: list[WrittenPart], declared: dict[str, tuple[np.dtype, Shape]]) -> Instance:
    """The Metadata of every rank's written part, as `create_default_global_save_plan` makes it: the ranks' items in
    order, each chunk numbered within its tensor (the index hint readers probe first); a tensor's chunks must cover
    exactly its declared elements."""
    chunks: dict[str, list[tuple[Shape, Shape]] | None] = {}  # (offsets, shape) by tensor, in the order first written; None: an object
    storage: list[tuple[Instance, Instance]] = []
    for part in parts:
        for key, offsets, shape, place in part.chunks:
            written = chunks.setdefault(key, [])
            storage.append((_index(key, offsets, len(written)), _storage(place)))
            written.append((offsets, shape))
        for key, place in part.objects:
            if key in chunks:
                raise AssertionError(f"'{key}' is written twice")
            chunks[key] = None
            storage.append((_index(key), _storage(place)))
    for key, (_, size) in declared.items():
        filled = sum(math.prod(shape) for _, shape in chunks.get(key) or ())
        if filled != math.prod(size):
            raise AssertionError(f"'{key}': chunks cover {filled} of {math.prod(size)} elements")

    def entry(key: str, written: list[tuple[Shape, Shape]] | None) -> Instance:
        if written is None:
            return Instance(Global(METADATA, "BytesStorageMetadata"))
        dtype, size = declared[key]
        return Instance(Global(METADATA, "TensorStorageMetadata"), {
            "properties": _tensor_properties(dtype), "size": _size(size),
            "chunks": [Instance(Global(METADATA, "ChunkStorageMetadata"), {"offsets": _size(offsets), "sizes": _size(shape)})
                       for offsets, shape in written],
        })

    return Instance(Global(METADATA, "Metadata"), {
        "state_dict_metadata": {key: entry(key, written) for key, written in chunks.items()}, "planner_data": None,
        "storage_data": Pairs(storage), "storage_meta": None, "version": VERSION,
    })


def write_metadata(directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[np.dtype, Shape]]) -> None:
    """`.metadata` from what every rank wrote, once the chunks cover every declared tensor exactly."""
    (directory / ".metadata").write_bytes(dumps(metadata_state(parts, declared)))
