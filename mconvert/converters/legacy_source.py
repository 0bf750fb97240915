"""The model weights of a Megatron-LM legacy `torch` checkpoint (mconvert.formats.legacy_torch) as the global
regions the way back reads.

Names are local to the rank: `decoder.layers.<i>.<name>` counts the layers of its pipeline stage from 0,
experts are numbered within their expert-parallel rank (`mlp.experts.local_experts.<j>.` for SequentialMLP,
`mlp.experts.linear_fc1.weight<j>` for TEGroupedMLP), and tensor-parallel tensors hold their rank's slice
(fc1 holds [gate_r; up_r]).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from mconvert.converters.plan import Piece, Plan
from mconvert.errors import ConversionError
from mconvert.formats.legacy_torch import read_rank_files
from mconvert.mcore import layout

Shape = tuple[int, ...]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# A multi-token prediction layer's decoder layer: its own scope, its experts numbered within the EP rank too.
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.+)$")

# Region index: (name within its scope, global layer or None, global expert or None).
Where = tuple[str, int | None, int | None]


def _expert(name: str, ep_rank: int, local_experts: int) -> tuple[str, int] | None:
    """A layer's local expert tensor (`name` within the layer) as its stored name and global expert number."""
    if (m := _SEQUENTIAL_EXPERT.match(name)) is not None:
        return layout.EXPERTS_PREFIX + m[2], ep_rank * local_experts + int(m[1])
    if (m := _GROUPED_EXPERT.match(name)) is not None:
        return f"{layout.EXPERTS_PREFIX}{m[1]}.{m[2]}", ep_rank * local_experts + int(m[3])
    return None


class LegacyCheckpoint:
    """The model weights of one iteration in the legacy format, as global regions."""

    def __init__(self, directory: Path):
        self.location = str(directory)
        self.args: argparse.Namespace | None
        self.args, files = read_rank_files(directory)
        self._index(files)

    def _index(self, files: dict[tuple[int, int, int], dict[str, torch.Tensor]]) -> None:
        """Local names to global regions: layers numbered across pipeline stages, experts across EP ranks."""
        stage_layers: dict[int, int] = {}
        for (tp, pp, ep), model in files.items():
            local = [int(m[1]) for name in model if (m := _LAYER.match(name))]
            stage_layers[pp] = max(stage_layers.get(pp, 0), max(local, default=-1) + 1)
        first_layer = {pp: sum(n for p, n in stage_layers.items() if p < pp) for pp in stage_layers}
        # (scope name, layer, expert) -> {TP rank: local tensor}
        self.shards: dict[Where, dict[int, torch.Tensor]] = {}
        for (tp, pp, ep), model in sorted(files.items()):
            local_experts = self._local_expert_count(model)
            for name, tensor in model.items():
                if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
                    continue
                where = self._where(name, first_layer[pp], ep, local_experts)
                shards = self.shards.setdefault(where, {})
                if tp in shards and not torch.equal(shards[tp], tensor):
                    raise ConversionError(f"{self.location}: ranks disagree on '{name}' (TP rank {tp})")
                shards[tp] = tensor

    @staticmethod
    def _local_expert_count(model: dict[str, torch.Tensor]) -> int:
        experts = set()
        for name in model:
            if (m := _LAYER.match(name)) is None:
                continue
            if (e := _SEQUENTIAL_EXPERT.match(m[2])) is not None:
                experts.add(int(e[1]))
            elif (e := _GROUPED_EXPERT.match(m[2])) is not None:
                experts.add(int(e[3]))
        return len(experts)

    @staticmethod
    def _where(name: str, first_layer: int, ep_rank: int, local_experts: int) -> Where:
        layer_match = _LAYER.match(name)
        if layer_match is None:
            if (mtp := _MTP_LAYER.match(name)) is not None and (expert := _expert(mtp[2], ep_rank, local_experts)):
                return mtp[1] + expert[0], None, expert[1]  # the stored key, with the expert's global number
            return name, None, None
        layer, sub = first_layer + int(layer_match[1]), layer_match[2]
        if expert := _expert(sub, ep_rank, local_experts):
            return expert[0], layer, expert[1]
        return sub, layer, None

    @staticmethod
    def _piece_where(piece: Piece, key: str) -> Where:
        if (m := _LAYER.match(key)) is not None:  # one key per layer: offsets hold only the expert
            return m[2], int(m[1]), piece.offsets[0] if piece.offsets else None
        if key.startswith("decoder.layers."):  # stacked: offsets are (layer,) or (layer, expert)
            return key.removeprefix("decoder.layers."), piece.offsets[0], piece.offsets[1] if len(piece.offsets) > 1 else None
        return key, None, piece.offsets[0] if piece.offsets else None  # an MTP layer's expert, or a whole tensor

    def _find(self, piece: Piece) -> tuple[str, Where, dict[int, torch.Tensor]] | None:
        """The piece's key and region as this checkpoint stores them: under the key's name, or under the local
        spec's name for it (a dense layer's norms, which the local spec keeps as modules of their own)."""
        for key in piece.keys:
            name, layer, expert = self._piece_where(piece, key)
            spellings = [name] + [
                local + name.removeprefix(stored) for local, stored in layout.LOCAL_SPEC_RENAMES.items() if name.startswith(stored)
            ]
            for where in ((spelling, layer, expert) for spelling in spellings):
                if where in self.shards:
                    return key, where, self.shards[where]
        return None

    @staticmethod
    def _is_split(piece: Piece, shards: dict[int, torch.Tensor]) -> bool:
        """Whether the TP ranks hold slices of the piece (rather than each a whole copy, as experts do
        without expert tensor parallelism, and norms always)."""
        axis, local = piece.layout.split_axis, shards[min(shards)]
        return axis is not None and local.dim() == len(piece.layout.shape) and local.shape[axis] != piece.layout.shape[axis]

    def _assemble_shape(self, piece: Piece, shards: dict[int, torch.Tensor]) -> Shape:
        """The global shape that the TP shards of a piece make together."""
        local = tuple(shards[min(shards)].shape)
        if not self._is_split(piece, shards):
            return local
        axis = piece.layout.split_axis
        return (*local[:axis], sum(t.shape[axis] for t in shards.values()), *local[axis + 1 :])

    @property
    def weights_dtype(self) -> torch.dtype | None:
        shards = self.shards.get(("embedding.word_embeddings.weight", None, None))
        return shards[min(shards)].dtype if shards else None

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        """Global shapes in the plan's key space (a stacked key's shape as its pieces show it), and the
        local names that no piece of the plan reads, so that checking against the plan reports them."""
        shapes: dict[str, Shape] = {}
        found: set[Where] = set()
        for piece in plan.pieces:
            located = self._find(piece)
            if located is None:
                continue
            key, where, shards = located
            found.add(where)
            leading = plan.shapes[piece.key][: len(piece.offsets)]
            shape = (*leading, *self._assemble_shape(piece, shards))
            if key not in shapes or shape != (*leading, *piece.layout.shape):
                shapes[key] = shape
        for where in self.shards.keys() - found:
            name, layer, expert = where
            label = name if layer is None else f"decoder.layers.{layer}.{name}" + ("" if expert is None else f" (expert {expert})")
            shapes[label] = tuple(self.shards[where][min(self.shards[where])].shape)
        return shapes

    def read_piece(self, piece: Piece, into: torch.Tensor | None = None) -> torch.Tensor:
        located = self._find(piece)
        assert located is not None, f"{piece.key} was checked present"
        shards = located[2]
        if not self._is_split(piece, shards):
            return shards[min(shards)]
        # Rank r of n holds `per_rank` fragments along the split axis: fragments r, r + n, ... (for fc1,
        # its gate and its up slice).
        layout, n = piece.layout, len(shards)
        per_rank = max(1, layout.fragments // n)
        fragments: list[torch.Tensor] = [torch.empty(0)] * (n * per_rank)
        for rank, tensor in shards.items():
            for j, part in enumerate(tensor.chunk(per_rank, dim=layout.split_axis)):
                fragments[rank + j * n] = part
        return torch.cat(fragments, dim=layout.split_axis)
