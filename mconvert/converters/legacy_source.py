"""The model weights of a Megatron-LM legacy `torch` checkpoint (mconvert.formats.legacy_torch) as the global
regions mcore-to-hf reads.

Names are the model's, local to the rank (mconvert.converters.model_keyed): layers counted within the pipeline
stage, experts within the expert-parallel rank; tensor-parallel tensors hold their rank's slice (fc1 holds
[gate_r; up_r]).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mconvert.converters.model_keyed import LAYER, ModelKeyedCheckpoint, Where, expert_numbers, where_stored
from mconvert.converters.plan import Piece
from mconvert.errors import ConversionError
from mconvert.formats.legacy_torch import read_rank_files

Shape = tuple[int, ...]


class LegacyCheckpoint(ModelKeyedCheckpoint):
    """The model weights of one iteration in the legacy format, as global regions: an entry per region holds its
    TP ranks' tensors."""

    format = "torch (legacy)"

    def __init__(self, directory: Path):
        self.location = str(directory)
        self.args: argparse.Namespace | None
        self.args, files = read_rank_files(directory)
        self._index(files)

    def _index(self, files: dict[tuple[int, int, int], dict[str, np.ndarray]]) -> None:
        """Local names to global regions: layers numbered across pipeline stages, experts across EP ranks."""
        stage_layers: dict[int, int] = {}
        for (tp, pp, ep), model in files.items():
            local = [int(m[1]) for name in model if (m := LAYER.match(name))]
            stage_layers[pp] = max(stage_layers.get(pp, 0), max(local, default=-1) + 1)
        first_layer = {pp: sum(n for p, n in stage_layers.items() if p < pp) for pp in stage_layers}
        # (scope name, layer, expert) -> {TP rank: local tensor}
        self.entries: dict[Where, dict[int, np.ndarray]] = {}
        for (tp, pp, ep), model in sorted(files.items()):
            local_experts = len(expert_numbers(model))
            for name, tensor in model.items():
                if name.endswith("_extra_state") or not isinstance(tensor, np.ndarray):
                    continue
                where = where_stored(name, first_layer[pp], ep * local_experts)
                shards = self.entries.setdefault(where, {})
                if tp in shards and not np.array_equal(shards[tp], tensor):
                    raise ConversionError(f"{self.location}: ranks disagree on '{name}' (TP rank {tp})")
                shards[tp] = tensor

    @staticmethod
    def _is_split(piece: Piece, shards: dict[int, np.ndarray]) -> bool:
        """Whether the TP ranks hold slices of the piece (rather than each a whole copy, as experts do
        without expert tensor parallelism, and norms always)."""
        axis, local = piece.layout.split_axis, shards[min(shards)]
        return axis is not None and local.ndim == len(piece.layout.shape) and local.shape[axis] != piece.layout.shape[axis]

    def entry_shape(self, piece: Piece | None, entry: dict[int, np.ndarray]) -> Shape:
        """The global shape that the TP shards of a region make together."""
        local = tuple(entry[min(entry)].shape)
        if piece is None or not self._is_split(piece, entry):
            return local
        axis = piece.layout.split_axis
        return (*local[:axis], sum(t.shape[axis] for t in entry.values()), *local[axis + 1 :])

    @property
    def weights_dtype(self) -> np.dtype | None:
        shards = self.entries.get(("embedding.word_embeddings.weight", None, None))
        return shards[min(shards)].dtype if shards else None

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> np.ndarray:
        located = self.find(piece)
        assert located is not None, f"{piece.key} was checked present"
        shards = located[2]
        if not self._is_split(piece, shards):
            return shards[min(shards)]
        # Rank r of n holds `per_rank` fragments along the split axis: fragments r, r + n, ... (for fc1,
        # its gate and its up slice).
        layout, n = piece.layout, len(shards)
        per_rank = max(1, layout.fragments // n)
        fragments: list[np.ndarray] = [np.empty(0)] * (n * per_rank)
        for rank, tensor in shards.items():
            for j, part in enumerate(np.split(tensor, per_rank, axis=layout.split_axis)):
                fragments[rank + j * n] = part
        return np.concatenate(fragments, axis=layout.split_axis)
