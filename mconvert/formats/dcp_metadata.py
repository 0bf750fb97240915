"""`.metadata` of a `torch_dist` checkpoint, made from what every rank wrote (`WrittenPart`): the pickle of the
`Metadata` that torch's DCP writes (`create_default_global_save_plan` over every rank's plan), written opcode by
opcode, naming torch's classes without importing them. Any DCP reader (megatron-core's included) unpickles it into
torch's own classes; tests/test_dcp_metadata.py holds it equal to what torch's planner makes.

Importing torch's DCP package to build it took 1.3-1.7 s on the 2-core box and 3.8-10.4 s on the 16-core GPU hosts
(it pulls in DTensor and sympy), holding the interpreter's lock through most of it: a conversion of a small model
spent most of its time there (docs/history.md, "The DCP import in a forked helper")."""

from __future__ import annotations

import math
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

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


@dataclass(frozen=True)
class _Global:
    """A module's attribute, named (pickle's GLOBAL): a class or function of torch's, never imported here."""

    module: str
    name: str


@dataclass(frozen=True)
class _Call:
    """`function(*args)` when unpickled (REDUCE)."""

    function: _Global
    args: tuple


@dataclass(frozen=True)
class _Pairs:
    """A dict of these (key, value) pairs when unpickled: its keys are instances, which only unpickling makes hashable."""

    items: list


@dataclass(frozen=True)
class _Instance:
    """An instance of `cls` made without its __init__ and given `state` (NEWOBJ, then BUILD): how a dataclass
    pickles, with its fields' dict or the tuple its __getstate__ returns (None: no state)."""

    cls: _Global
    state: object = None


def _size(shape: Shape) -> _Call:
    return _Call(_Global("torch", "Size"), (tuple(shape),))


def _tensor_properties(dtype: torch.dtype) -> _Instance:
    """TensorProperties(dtype) with its defaults, in the tuple its __getstate__ gives: dtype, layout, requires_grad,
    memory format (as DCP encodes it), pin_memory."""
    layout = _Call(_Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = _Call(_Global(METADATA, "_MEM_FORMAT_ENCODING"), (0,))
    dtype_name = str(dtype).removeprefix("torch.")
    return _Instance(_Global(METADATA, "TensorProperties"), (_Global("torch", dtype_name), layout, False, contiguous, False))


def _index(key: str, offsets: Shape | None = None, number: int | None = None) -> _Instance:
    return _Instance(_Global(METADATA, "MetadataIndex"), {"fqn": key, "offset": None if offsets is None else _size(offsets), "index": number})


def _storage(place: Place) -> _Instance:
    path, offset, length = place
    return _Instance(_Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     {"relative_path": path, "offset": offset, "length": length})


def metadata_state(parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> _Instance:
    """The Metadata of every rank's written part, as `create_default_global_save_plan` makes it: the ranks' items in
    order, each chunk numbered within its tensor (the index hint readers probe first); a tensor's chunks must cover
    exactly its declared elements."""
    chunks: dict[str, list[tuple[Shape, Shape]] | None] = {}  # (offsets, shape) by tensor, in the order first written; None: an object
    storage: list[tuple[_Instance, _Instance]] = []
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

    def entry(key: str, written: list[tuple[Shape, Shape]] | None) -> _Instance:
        if written is None:
            return _Instance(_Global(METADATA, "BytesStorageMetadata"))
        dtype, size = declared[key]
        return _Instance(_Global(METADATA, "TensorStorageMetadata"), {
            "properties": _tensor_properties(dtype), "size": _size(size),
            "chunks": [_Instance(_Global(METADATA, "ChunkStorageMetadata"), {"offsets": _size(offsets), "sizes": _size(shape)})
                       for offsets, shape in written],
        })

    return _Instance(_Global(METADATA, "Metadata"), {
        "state_dict_metadata": {key: entry(key, written) for key, written in chunks.items()}, "planner_data": None,
        "storage_data": _Pairs(storage), "storage_meta": None, "version": VERSION,
    })


class _Pickle:
    """Pickle protocol 2's opcodes for the values above: None, bools, ints, strings, tuples, lists, dicts, and the
    stand-ins. Each global is written once and fetched from the memo after (as pickle.dump does, keeping a file of
    many chunks small)."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[_Global, int] = {}

    def save(self, value: object) -> None:
        out = self.out
        if value is None:
            out += b"N"
        elif value is True or value is False:
            out += b"\x88" if value else b"\x89"
        elif isinstance(value, int):
            if 0 <= value < 1 << 8:
                out += b"K" + bytes((value,))
            elif -(1 << 31) <= value < 1 << 31:
                out += b"J" + struct.pack("<i", value)
            else:
                encoded = pickle.encode_long(value)
                out += b"\x8a" + bytes((len(encoded),)) + encoded
        elif isinstance(value, str):
            encoded = value.encode()
            out += b"X" + struct.pack("<I", len(encoded)) + encoded
        elif isinstance(value, tuple):
            self._run(b"(", value, b"t")
        elif isinstance(value, list):
            self._run(b"](", value, b"e")
        elif isinstance(value, (dict, _Pairs)):
            pairs = value.items() if isinstance(value, dict) else value.items
            self._run(b"}(", [item for pair in pairs for item in pair], b"u")
        elif isinstance(value, _Global):
            self._global(value)
        elif isinstance(value, _Call):
            self.save(value.function)
            self.save(value.args)
            out += b"R"
        elif isinstance(value, _Instance):
            self.save(value.cls)
            out += b")\x81"
            if value.state is not None:
                self.save(value.state)
                out += b"b"
        else:
            raise TypeError(f"no pickle of {type(value).__name__} here")

    def _run(self, start: bytes, items, end: bytes) -> None:
        """`items` between a start (a MARK, after an empty list or dict) and the opcode that takes them."""
        self.out += start
        for item in items:
            self.save(item)
        self.out += end

    def _global(self, value: _Global) -> None:
        if value in self.memo:
            self.out += b"j" + struct.pack("<I", self.memo[value])
            return
        self.out += b"c" + value.module.encode() + b"\n" + value.name.encode() + b"\n"
        self.memo[value] = len(self.memo)
        self.out += b"r" + struct.pack("<I", self.memo[value])


def write_metadata(directory: Path, parts: list[WrittenPart], declared: dict[str, tuple[torch.dtype, Shape]]) -> None:
    """`.metadata` from what every rank wrote, once the chunks cover every declared tensor exactly."""
    pickled = _Pickle()
    pickled.save(metadata_state(parts, declared))
    pickled.out += b"."
    (directory / ".metadata").write_bytes(bytes(pickled.out))
