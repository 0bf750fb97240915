"""The Megatron checkpoints mcore-to-hf reads, behind one protocol: a torch_dist directory (through its DCP
metadata), Megatron-LM's legacy per-rank `torch` files (mconvert.converters.legacy_source), its FSDP saves
(fsdp_dtensor and torch_dcp: mconvert.converters.fsdp_saves), or a global state dict in memory (torch tensors, the state-dict API's; the formats on disk read into numpy arrays); the one function
that tells which kind a directory holds and opens its reader (open_megatron_checkpoint); and where a plan piece
lies in a stored tensor."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mconvert.converters.bridge_saves import LANGUAGE_MODEL, LanguageModelTensors
from mconvert.converters.fsdp_saves import FsdpCheckpoint
from mconvert.converters.legacy_source import LegacyCheckpoint
from mconvert.converters.plan import Piece, Plan
from mconvert.converters.save_folders import SWIFT_ARGS
from mconvert.converters.swift_saves import SwiftLanguageModel, SwiftTensors
from mconvert.dtypes import dtype_of
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.legacy_torch import is_legacy_checkpoint
from mconvert.mcore import fsdp_dtensor
from mconvert.mcore.checkpoint import iteration_dir, read_common_args
from mconvert.mcore.layout import MODEL_KEY_PREFIXES, OPTIMIZER_KEY

Shape = tuple[int, ...]


class MegatronTensors(Protocol):
    """A Megatron checkpoint's model weights, whatever the format: global shapes, and regions on demand."""

    args: argparse.Namespace | None
    location: str  # for messages
    format: str  # Megatron-LM's name for it (--ckpt-format)

    @property
    def weights_dtype(self) -> Any:
        """The dtype the weights are stored in (the word embedding's), None when there is no embedding."""
        ...

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        """Every stored model tensor's global shape (vocabulary padded as saved), by checkpoint key."""
        ...

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> Any:
        """The piece's region (layout shape, but the vocabulary rows as stored; a numpy array, or the state dict's torch
        tensor), in `into` (a uint8 array
        of at least its bytes) where the format reads into given memory. Safe to call from several threads."""
        ...

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: np.dtype) -> tuple[Path, int] | None:
        """(file, position) of a region of the stored tensor `key` where it lies in a file as one run of bytes of
        `dtype`, to be copied file to file; None where it does not, or the format does not say."""
        ...


def stored_key(piece: Piece, shapes: dict[str, Shape]) -> str:
    """The key a piece is stored under: the first of its names that the checkpoint has."""
    return next((key for key in piece.keys if key in shapes), piece.key)


def piece_region(piece: Piece, stored_shape: Shape) -> tuple[Shape, Shape]:
    """(offsets, shape) of a piece's region in the global tensor, with all its vocabulary rows as stored."""
    layout_shape = piece.layout.shape
    if piece.layout.real_rows is not None:
        layout_shape = (stored_shape[len(piece.offsets)], *layout_shape[1:])
    leading = len(piece.offsets)
    return (*piece.offsets, *(0,) * len(layout_shape)), (*(1,) * leading, *layout_shape)


@dataclass
class TorchDistTensors:
    """The model weights of a torch_dist checkpoint, read chunk by chunk through its DCP metadata."""

    dcp: DCPCheckpoint
    args: argparse.Namespace | None
    format = "torch_dist"

    @property
    def location(self) -> str:
        return str(self.dcp.directory)

    @property
    def weights_dtype(self) -> np.dtype | None:
        return self.dcp.dtypes.get("embedding.word_embeddings.weight")

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        return {k: v for k, v in self.dcp.shapes.items() if not OPTIMIZER_KEY.match(k)}

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> np.ndarray:
        key = stored_key(piece, self.dcp.shapes)
        region = self.dcp.read_region(key, *piece_region(piece, self.dcp.shapes[key]), into=into)
        return region.reshape(region.shape[len(piece.offsets) :])

    def read_whole(self, key: str, offsets: Shape) -> np.ndarray:
        """The stored tensor `key` whole (a layer's, at `offsets` of a stacked one, without its leading axes)."""
        if key not in self.dcp.shapes:
            raise ConversionError(f"{self.location}: tensor '{key}' is missing from the checkpoint")
        shape = self.dcp.shapes[key]
        region = (*(1,) * len(offsets), *shape[len(offsets) :])
        return self.dcp.read_region(key, (*offsets, *(0,) * (len(shape) - len(offsets))), region).reshape(region[len(offsets) :])

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: np.dtype) -> tuple[Path, int] | None:
        return self.dcp.byte_span(key, offsets, shape) if dtype_of(self.dcp.dtypes[key]) == dtype else None


@dataclass
class StateDictTensors:
    """A Megatron global state dict in memory (checkpoint key -> whole tensor), e.g. gathered from ranks."""

    state_dict: dict[str, Any]  # torch tensors
    args: argparse.Namespace | None = None
    location: str = "the Megatron state dict"
    format = "state dict"

    @property
    def weights_dtype(self) -> Any:
        embedding = self.state_dict.get("embedding.word_embeddings.weight")
        return None if embedding is None else embedding.dtype

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        return {k: tuple(v.shape) for k, v in self.state_dict.items() if k.startswith(MODEL_KEY_PREFIXES)}

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> Any:
        return self.state_dict[stored_key(piece, self.state_dict)][piece.offsets]

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: np.dtype) -> None:
        return None


def open_megatron_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None) -> MegatronTensors:
    """The reader of a Megatron save at the iteration the tracker file names (or `iteration`): the one place that
    tells, from the iteration directory's files, which kind of save it is.

    - Megatron-LM's legacy `torch` format: a `model_optim_rng.pt` per model-parallel rank (`mp_rank_*/`).
    - torch_dist: a DCP folder with metadata.json, written by mconvert, Megatron-LM or megatron-core alone, whose
      args (common.pt, or a `common_state` object) describe the model, describe none (ms-swift) or are absent (a
      bare model's save: Megatron-Bridge); a vision-language model's, the language model under `language_model.`
      (Megatron-Bridge's Qwen3.5: mconvert.converters.bridge_saves; ms-swift's: its vision tower under `visual.`);
      ms-swift's, its args.json beside, whose Qwen3-Next and Qwen3.5 delta-net layers are laid out otherwise
      (mconvert.converters.swift_saves).
    - Megatron-FSDP's fsdp_dtensor: a DCP folder without metadata.json, the model under `model.module.`.
    - FSDP2's torch_dcp: the same, the model under `model.`.
    """
    load_dir = Path(load_dir)
    directory = iteration_dir(load_dir, iteration)
    if not directory.is_dir():
        raise ConversionError(f"{load_dir}: the tracker file names {directory.name}, which does not exist")
    if is_legacy_checkpoint(directory):
        return LegacyCheckpoint(directory)
    if not (directory / ".metadata").exists():
        raise ConversionError(
            f"{directory}: not a Megatron checkpoint (no .metadata of torch_dist or an FSDP save, no mp_rank_* of the torch format)"
        )
    dcp = DCPCheckpoint(directory)
    if (directory / "metadata.json").exists():
        tensors, swift = TorchDistTensors(dcp, read_common_args(directory, dcp)), (load_dir / SWIFT_ARGS).exists()
        if any(key.startswith(LANGUAGE_MODEL) for key in dcp.shapes):
            tensors = SwiftLanguageModel(tensors) if swift else LanguageModelTensors(tensors)
        return SwiftTensors(tensors) if swift else tensors
    megatron_fsdp = any(key.startswith(fsdp_dtensor.MODEL_PREFIX) for key in dcp.shapes)
    return FsdpCheckpoint(dcp, fsdp_dtensor.FORMAT if megatron_fsdp else "torch_dcp")
