"""Reading the `torch.save` files Megatron writes (common.pt, a torch_dist checkpoint's common state and chunks, legacy
per-rank files, an FSDP save's objects) without torch and without running anything they name.

They are pickles inside a zip archive (mconvert.formats.torch_save). Their tensors come back as numpy arrays over the
file's memory map (read only when touched, so a legacy file's optimizer state is never read), bfloat16 and float8 as
ml_dtypes' (mconvert.dtypes). Besides tensors, containers and the args `Namespace`, Megatron-LM's stored args hold
torch dtypes (read as numpy's), its own enums (attention backend, CUDA graph scope, ...), `signal.Signals` and
numpy's RNG state. The globals let through are those of torch's weights-only unpickler that plain tensors need, the
args Namespace and numpy's arrays as themselves, and Megatron's, Transformer Engine's, `signal`'s classes and
`torch.device` as inert stand-ins (`StoredObject`) that record what they were built from, so that neither torch,
megatron-core nor TE is needed, and nothing of theirs is imported or run. Any other global is refused.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import io
import math
import mmap
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.dtypes import STORED, strided
from mconvert.errors import ConversionError
from mconvert.formats.torch_save import STORAGE_CLASSES, member, member_start, record_entries

# Classes whose values are kept as stand-ins: what Megatron-LM's stored args hold besides plain values.
_INERT_MODULES = ("megatron.", "transformer_engine.", "signal")
# Each typed storage class's element dtype (torch.cuda's too: a tensor saved from the GPU reads the same).
_STORAGE_DTYPES = {name: STORED[dtype] for dtype, name in STORAGE_CLASSES.items()} | {
    "ComplexFloatStorage": STORED["complex64"], "ComplexDoubleStorage": STORED["complex128"],
}


class StoredObject:
    """A value of a class that is not loaded (a Megatron enum in stored args): its class's qualified name and
    what it was built from."""

    qualified_name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name}{self.args!r}>"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.args == self.args


def _stand_in(qualified_name: str) -> type[StoredObject]:
    return type(qualified_name.rsplit(".", 1)[-1], (StoredObject,), {"qualified_name": qualified_name})


class _StorageClass:
    """A storage class a pickle names, by its element dtype."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype


def _tensor(storage: np.ndarray, offset: int, size: Any, stride: Any, dtype: np.dtype) -> np.ndarray:
    """The tensor (storage offset, size, stride in elements of `dtype`) over a storage's bytes, checked to lie within
    them: a pickle's claims never reach memory outside its storage."""
    size, stride = tuple(size), tuple(stride)
    if not all(isinstance(n, int) and n >= 0 for n in (offset, *size, *stride)) or len(size) != len(stride):
        raise pickle.UnpicklingError(f"a tensor of size {size}, stride {stride} at {offset}")
    elements = storage.size // dtype.itemsize
    if math.prod(size) == 0:
        return np.empty(size, dtype=dtype)
    if offset + sum((n - 1) * s for n, s in zip(size, stride)) >= elements:
        raise pickle.UnpicklingError(f"a tensor of size {list(size)} at {offset} reaches past its storage's {elements} elements")
    flat = storage[: elements * dtype.itemsize].view(dtype)[offset:]
    return strided(flat, size, tuple(s * dtype.itemsize for s in stride), writeable=False)


def _rebuild_tensor_v2(storage: tuple[np.ndarray, np.dtype], offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _tensor(storage[0], offset, size, stride, storage[1])


def _rebuild_tensor_v3(storage: tuple[np.ndarray, np.dtype], offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    """A tensor of a dtype without a typed storage class (float8, uint16, ...): its storage's bytes as `dtype`."""
    if not isinstance(dtype, np.dtype):
        raise pickle.UnpicklingError(f"a tensor of dtype {dtype!r}")
    return _tensor(storage[0], offset, size, stride, dtype)


def _parameter(data, *rest):
    return data


def _from_type(function, new_type, args, state):
    """A tensor of a subclass (a Parameter's, or a plain Tensor's): the tensor its own rebuild makes."""
    return function(*args)


def _encode(text: str, encoding: str) -> bytes:
    """Protocol 2's bytes objects: `_codecs.encode(str, "latin1")`."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _bytearray(*args):
    """A bytearray of bytes the pickle holds (never one of a size it claims: bytearray(10**12) fills that much)."""
    if args and not isinstance(args[0], (bytes, str)):
        raise pickle.UnpicklingError(f"bytearray of a {type(args[0]).__name__}")
    return bytearray(*args)


def _permitted_globals() -> dict[str, object]:
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    permitted: dict[str, object] = {
        "argparse.Namespace": argparse.Namespace,
        "collections.OrderedDict": collections.OrderedDict,
        "collections.Counter": collections.Counter,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.bytearray": _bytearray, "builtins.complex": complex,
        "_codecs.encode": _encode,
        "torch.Size": tuple,
        "torch.serialization._get_layout": str,
        "torch._utils._rebuild_tensor": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _parameter,
        "torch._utils._rebuild_parameter_with_state": _parameter,
        "torch._tensor._rebuild_from_type_v2": _from_type,
        "torch.Tensor": _stand_in("torch.Tensor"),
        "torch.nn.parameter.Parameter": _stand_in("torch.nn.parameter.Parameter"),
        "torch.storage.UntypedStorage": _StorageClass(STORED["uint8"]),
        "numpy.ndarray": np.ndarray,
        "numpy.dtype": np.dtype,
        f"{multiarray.__name__}._reconstruct": multiarray._reconstruct,
    }
    if hasattr(np, "dtypes"):
        permitted["numpy.dtypes.UInt32DType"] = np.dtypes.UInt32DType
    permitted |= {f"torch.{name}": dtype for name, dtype in STORED.items()}
    for module in ("torch", "torch.cuda"):
        permitted |= {f"{module}.{name}": _StorageClass(dtype) for name, dtype in _STORAGE_DTYPES.items()}
    return permitted


_PERMITTED = _permitted_globals()


class _SavedUnpickler(pickle._Unpickler):
    """Python's own unpickler (its memo in a dict, bounded by the pickle's length, as for DCP's metadata), letting
    through only `_PERMITTED` and the inert stand-ins; a storage is its bytes in the mapped file."""

    def __init__(self, file, storage_bytes):
        super().__init__(file)
        self._storage_bytes = storage_bytes
        self._storages: dict[str, np.ndarray] = {}
        self.refused: str | None = None

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # torch.save's protocol 2 names Python 2's modules: `__builtin__.set`
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        qualified = f"{module}.{name}"
        if qualified in _PERMITTED:
            return _PERMITTED[qualified]
        if module.startswith(_INERT_MODULES) or qualified == "torch.device":
            return _stand_in(qualified)
        self.refused = qualified
        raise pickle.UnpicklingError(f"{qualified} is not allowed")

    def persistent_load(self, pid: Any) -> tuple[np.ndarray, np.dtype]:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageClass)
                and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f"a persistent id {pid!r:.80}, not a storage")
        _, storage_class, key, _, numel = pid
        if key not in self._storages:
            self._storages[key] = self._storage_bytes(key)
        data, needed = self._storages[key], numel * storage_class.dtype.itemsize
        if data.size < needed:
            raise pickle.UnpicklingError(f"storage {key} holds {data.size} bytes, its tensor claims {needed}")
        return data[:needed], storage_class.dtype


def load_megatron_file(path: str | os.PathLike, location: str, offset: int = 0, length: int | None = None) -> Any:
    """What `torch.save` wrote to `path` (or at [offset, offset + length) of it: a DCP item), tensors as numpy arrays
    over the file's memory map, letting through only tensors, containers, the args Namespace, torch dtypes, numpy's
    RNG state and inert stand-ins for Megatron's, TE's and `signal`'s classes. `location` names the file in errors."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = size - offset if length is None else length
        try:
            entries = record_entries(f, offset, length)
            pickled = entries.get("data.pkl")
            if pickled is None:
                raise ValueError("no data.pkl in a zip archive")
            if any(entry.compress_type != zipfile.ZIP_STORED for entry in entries.values()):
                raise ValueError("compressed members")
            starts = {name: member_start(f, offset, entry) for name, entry in entries.items()}
            if any(starts[name] + entry.file_size > offset + length for name, entry in entries.items()):
                raise ValueError("a member reaches past its end")
            data = member(f, offset, pickled)
            order = member(f, offset, entries["byteorder"]) if "byteorder" in entries else b"little"
        except Exception as e:  # noqa: BLE001 (a damaged archive fails zipfile's parsing in many ways: one to the user)
            raise ConversionError(f"{location}: not a torch.save file ({(str(e) or type(e).__name__).splitlines()[0]})") from None
        if order != b"little":
            raise ConversionError(f"{location}: not a little-endian torch.save file (its byteorder record holds {order!r:.40})")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def storage_bytes(key: str) -> np.ndarray:
        entry = entries.get(f"data/{key}")
        if entry is None:
            raise pickle.UnpicklingError(f"storage {key} is not in the archive")
        return np.frombuffer(mapped, dtype=np.uint8, count=entry.file_size, offset=starts[f"data/{key}"])

    unpickler = _SavedUnpickler(io.BytesIO(data), storage_bytes)
    try:
        return unpickler.load()
    except Exception as e:  # noqa: BLE001 (a damaged pickle fails the unpickler in many ways: one to the user)
        if unpickler.refused is not None:
            raise ConversionError(f"{location}: holds objects of {unpickler.refused}, which are not loaded (not weights)") from None
        raise ConversionError(f"{location}: not a readable torch.save file ({(str(e) or type(e).__name__).splitlines()[0]})") from None
