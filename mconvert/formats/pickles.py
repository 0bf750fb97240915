"""Reading the `torch.save` files Megatron writes (common.pt, a torch_dist checkpoint's common state, legacy
per-rank files) without running anything they name.

They are pickles: besides tensors, containers and the args `Namespace`, Megatron-LM's stored args hold its own
enums (attention backend, CUDA graph scope, ...), `signal.Signals` and numpy's RNG state. Those few kinds are
let through torch's weights-only unpickler: the args Namespace and numpy's array as themselves, Megatron's,
Transformer Engine's and `signal`'s classes as inert stand-ins (`StoredObject`) that record what they were built
from, so that neither megatron-core nor TE is needed, and nothing of theirs is imported or run. Any other
global is refused before a byte is unpickled.
"""

from __future__ import annotations

import argparse
import os
from typing import IO, Any

from mconvert.errors import ConversionError

# Classes whose values are kept as stand-ins: what Megatron-LM's stored args hold besides plain values.
_INERT_MODULES = ("megatron.", "transformer_engine.", "signal")


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


def _permitted_globals() -> dict[str, object]:
    permitted: dict[str, object] = {"argparse.Namespace": argparse.Namespace}
    try:
        import numpy

        multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray
        permitted.update({
            "numpy.ndarray": numpy.ndarray,
            "numpy.dtype": numpy.dtype,
            f"{multiarray.__name__}._reconstruct": multiarray._reconstruct,
        })
        if hasattr(numpy, "dtypes"):
            permitted["numpy.dtypes.UInt32DType"] = numpy.dtypes.UInt32DType
    except ImportError:
        pass
    return permitted


_PERMITTED = _permitted_globals()


def _stand_in(qualified_name: str) -> type[StoredObject]:
    return type(qualified_name.rsplit(".", 1)[-1], (StoredObject,), {"qualified_name": qualified_name})


def load_megatron_file(source: str | os.PathLike | IO[bytes], location: str, mmap: bool = False) -> Any:
    """`torch.load` of a Megatron `torch.save` file (a path, or a seekable binary file object), letting through
    only tensors, containers, the args Namespace, numpy's RNG state and inert stand-ins for Megatron's, TE's
    and `signal`'s classes. `location` names the file in errors."""
    import torch

    try:
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception as e:  # noqa: BLE001 (any failure to read the archive means the same to the user)
        raise ConversionError(f"{location}: not a torch.save file ({e})") from None
    if hasattr(source, "seek"):
        source.seek(0)
    refused = {name for name in needed if name not in _PERMITTED and not name.startswith(_INERT_MODULES)}
    if refused:
        raise ConversionError(f"{location}: holds objects of {', '.join(sorted(refused))}, which are not loaded (not weights)")
    allowed = [
        (_PERMITTED[name], name) if name in _PERMITTED else (_stand_in(name), name)
        for name in sorted(needed)
    ]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 (a damaged archive fails in torch.load's parsing in many ways: one to the user)
        raise ConversionError(f"{location}: not a readable torch.save file ({(str(e) or type(e).__name__).splitlines()[0]})") from None
