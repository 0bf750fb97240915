"""A reader that presents another reader's save otherwise: another tool's layout read as megatron-core's
(Megatron-Bridge's and ms-swift's vision-language models, ms-swift's fused delta-net tensors). The save's args,
location, format and weights' dtype are those of the reader it wraps (`inner`), and what it does not change is read
through it; each kind overrides what it changes. A module of its own: mcore_sources imports the tools' modules, which
build on it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

Shape = tuple[int, ...]
Reader = TypeVar("Reader")


@dataclass
class WrappedSave:
    inner: Any  # the reader of the save (mcore_sources.TorchDistTensors), or another WrappedSave
    format = "torch_dist"

    @property
    def args(self) -> argparse.Namespace | None:
        return self.inner.args

    @property
    def location(self) -> str:
        return self.inner.location

    @property
    def weights_dtype(self) -> Any:
        return self.inner.weights_dtype

    def read_whole(self, key: str, offsets: Shape) -> np.ndarray:
        """The stored tensor `key` whole (a layer's, at `offsets` of a stacked one, without its leading axes)."""
        return self.inner.read_whole(key, offsets)

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: np.dtype) -> tuple[Path, int] | None:
        return self.inner.byte_span(key, offsets, shape, dtype)


def wrapped(source: Any, kind: type[Reader]) -> Reader | None:
    """The reader of `kind` that `source` is or wraps, else None."""
    while not isinstance(source, kind) and isinstance(source, WrappedSave):
        source = source.inner
    return source if isinstance(source, kind) else None
