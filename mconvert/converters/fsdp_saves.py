"""Megatron-LM's FSDP saves, read as the global regions mcore-to-hf reads.

Megatron-LM 0.19 saves a run under Megatron-FSDP (`--use-megatron-fsdp`) in its `fsdp_dtensor` format and one
under PyTorch's FSDP2 (`--use-torch-fsdp2`) in `torch_dcp`: both are plain DCP folders (a `.metadata`, no
torch_dist `metadata.json`) of the training state dict, flattened with dots. The model's tensors are keyed by
the model's own names (mconvert.converters.model_keyed), each stored whole (its global shape; chunks are the
data-parallel ranks' rows):

- fsdp_dtensor: `model.module.<name>`, a SwiGLU fc1 in halves (mconvert.mcore.fsdp_dtensor).
- torch_dcp: `model.<name>`, nothing split; Transformer Engine's `_extra_state` beside the weights.

Megatron-FSDP stores its fp32 main parameters, in a bf16 run too: the export keeps fp32 unless told a dtype.

Beside them lie the optimizer's state (`optimizer.*`, never read), the RNG and scheduler states, and `args`,
`iteration`, `checkpoint_version` as torch.save'd objects. A run with pipeline stages numbers each stage's layers
from 0 under the same names, which no reader can tell apart: such saves are refused.
"""

from __future__ import annotations

import argparse

import numpy as np

from mconvert.converters.model_keyed import ModelKeyedCheckpoint, Where, where_stored
from mconvert.converters.plan import Piece
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore import fsdp_dtensor

Shape = tuple[int, ...]
# Each format's prefix of the model's names.
MODEL_PREFIXES = {fsdp_dtensor.FORMAT: fsdp_dtensor.MODEL_PREFIX, "torch_dcp": "model."}
FSDP_FORMATS = tuple(MODEL_PREFIXES)


class FsdpCheckpoint(ModelKeyedCheckpoint):
    """One iteration of an fsdp_dtensor or torch_dcp save (`format`, as mcore_sources.open_megatron_checkpoint tells
    it): an entry per region names the DCP key that holds it, or the two (gate, up) that Megatron-FSDP split it into."""

    def __init__(self, dcp: DCPCheckpoint, format: str):
        self.dcp = dcp
        directory = dcp.directory
        self.location = str(directory)
        self.format = format
        self.args = self._read_args()
        stages = getattr(self.args, "pipeline_model_parallel_size", 1) or 1
        if stages > 1:
            raise ConversionError(
                f"{directory}: a {self.format} save of {stages} pipeline stages: each stage names its layers from 0, "
                "so the stages' layers cannot be told apart"
            )
        prefix = MODEL_PREFIXES[self.format]
        halves: dict[str, dict[str, str]] = {}
        self.entries: dict[Where, tuple[str, ...]] = {}
        for key in self.dcp.shapes:
            if not key.startswith(prefix) or key.endswith("_extra_state"):
                continue
            name = key.removeprefix(prefix)
            if self.format == "fsdp_dtensor" and (half := fsdp_dtensor.HALF.match(name)) is not None:
                halves.setdefault(half[1], {})[half[2]] = key
                continue
            self.entries[where_stored(name)] = (key,)
        for name, parts in halves.items():
            if parts.keys() != {"w", "v"}:
                raise ConversionError(f"{directory}: '{prefix}{name}' has its {'gate' if 'w' in parts else 'up'} half alone")
            self.entries[where_stored(name)] = (parts["w"], parts["v"])
        if not self.entries:
            raise ConversionError(f"{directory}: a DCP folder without torch_dist's metadata.json and without model weights "
                                  f"under {' or '.join(repr(p) for p in MODEL_PREFIXES.values())}: not a Megatron-LM save")

    def _read_args(self) -> argparse.Namespace | None:
        if "args" not in self.dcp.object_keys:
            return None
        args = self.dcp.read_object("args")
        if not isinstance(args, argparse.Namespace):
            raise ConversionError(f"{self.location}: its 'args' hold a {type(args).__name__}, not Megatron-LM's arguments")
        return args

    def entry_shape(self, piece: Piece | None, entry: tuple[str, ...]) -> Shape:
        first, *rest = (self.dcp.shapes[key] for key in entry)
        return (first[0] + sum(shape[0] for shape in rest), *first[1:])

    @property
    def weights_dtype(self) -> np.dtype | None:
        entry = self.entries.get(("embedding.word_embeddings.weight", None, None))
        return self.dcp.dtypes[entry[0]] if entry else None

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> np.ndarray:
        located = self.find(piece)
        assert located is not None, f"{piece.key} was checked present"
        keys = located[2]
        if len(keys) == 1:
            return self._read_whole(keys[0], into)
        return np.concatenate([self._read_whole(key) for key in keys])

    def _read_whole(self, key: str, into: np.ndarray | None = None) -> np.ndarray:
        shape = self.dcp.shapes[key]
        return self.dcp.read_region(key, (0,) * len(shape), shape, into=into)
