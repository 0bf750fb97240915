"""Pickles written opcode by opcode (protocol 2), naming classes and functions by module and name without importing
them: what torch.save's records and DCP's `.metadata` hold names torch's classes, which a conversion never imports
(mconvert.dtypes says why). `dumps` takes plain values (None, bools, ints, floats, strings, tuples, lists,
dicts), the stand-ins below, an argparse Namespace (as pickle saves one), and dtypes: torch's, and numpy's as
torch's of the same name."""

from __future__ import annotations

import argparse
import pickle
import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Global:
    """A module's attribute, named (pickle's GLOBAL): a class, function or dtype, never imported here."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """`function(*args)` when unpickled (REDUCE)."""

    function: Global
    args: tuple


@dataclass(frozen=True)
class Pairs:
    """A dict of these (key, value) pairs when unpickled: its keys are instances, which only unpickling makes hashable."""

    items: list


@dataclass(frozen=True)
class Instance:
    """An instance of `cls` made without its __init__ and given `state` (NEWOBJ, then BUILD): how a dataclass
    pickles, with its fields' dict or the tuple its __getstate__ returns (None: no state)."""

    cls: Global
    state: object = None


@dataclass(frozen=True)
class Persistent:
    """A persistent id (BINPERSID): how torch.save's pickle refers to a storage kept beside it."""

    pid: tuple


class _Pickler:
    """Pickle protocol 2's opcodes for the values `dumps` takes. Each global is written once and fetched from the memo
    after (as pickle.dump does, keeping a file of many chunks small)."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[Global, int] = {}

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
        elif isinstance(value, float):
            out += b"G" + struct.pack(">d", value)
        elif isinstance(value, str):
            encoded = value.encode()
            out += b"X" + struct.pack("<I", len(encoded)) + encoded
        elif isinstance(value, tuple):
            self._run(b"(", value, b"t")
        elif isinstance(value, list):
            self._run(b"](", value, b"e")
        elif isinstance(value, (dict, Pairs)):
            pairs = value.items() if isinstance(value, dict) else value.items
            self._run(b"}(", [item for pair in pairs for item in pair], b"u")
        elif isinstance(value, Global):
            self._global(value)
        elif isinstance(value, Call):
            self.save(value.function)
            self.save(value.args)
            out += b"R"
        elif isinstance(value, Persistent):
            self.save(value.pid)
            out += b"Q"
        elif isinstance(value, argparse.Namespace):
            self.save(Instance(Global("argparse", "Namespace"), vars(value)))
        elif isinstance(value, np.dtype) or type(value).__module__ == "torch" and type(value).__name__ == "dtype":
            self.save(Global("torch", str(value).removeprefix("torch.")))
        elif isinstance(value, Instance):
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

    def _global(self, value: Global) -> None:
        if value in self.memo:
            self.out += b"j" + struct.pack("<I", self.memo[value])
            return
        self.out += b"c" + value.module.encode() + b"\n" + value.name.encode() + b"\n"
        self.memo[value] = len(self.memo)
        self.out += b"r" + struct.pack("<I", self.memo[value])


def dumps(value: object) -> bytes:
    pickled = _Pickler()
    pickled.save(value)
    return bytes(pickled.out + b".")
