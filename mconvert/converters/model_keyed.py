"""Checkpoints keyed by the model's own parameter names (what a module's `state_dict()` calls them), read as the
global regions of torch_dist's keys that mcore-to-hf reads: Megatron-LM's legacy `torch` format
(mconvert.converters.legacy_source) and its FSDP formats (mconvert.converters.fsdp_saves), the first of which
mconvert also writes under these names.

Such names count layers from 0 within their pipeline stage (`decoder.layers.<i>.<name>`), may number experts
within their expert-parallel rank (`mlp.experts.local_experts.<j>.` for SequentialMLP,
`mlp.experts.linear_fc1.weight<j>` for TEGroupedMLP), and call a multi-token prediction layer's decoder layer
`mtp_model_layer` (megatron-core 0.19's module name) where torch_dist keys say `transformer_layer`.
"""

from __future__ import annotations

import re
from typing import Any

from mconvert.converters.plan import Piece, Plan
from mconvert.mcore import layout

Shape = tuple[int, ...]
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# A multi-token prediction layer's decoder layer: its own scope, its experts numbered like a layer's.
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.(.+)$")

# A region of the global model: (name within its scope, global layer or None, global expert or None).
Where = tuple[str, int | None, int | None]


def expert_number(name: str, first_expert: int) -> tuple[str, int] | None:
    """A layer's expert tensor (`name` within the layer) as its torch_dist name and global expert number, the
    stored number counted from `first_expert`."""
    if (m := SEQUENTIAL_EXPERT.match(name)) is not None:
        return layout.EXPERTS_PREFIX + m[2], first_expert + int(m[1])
    if (m := GROUPED_EXPERT.match(name)) is not None:
        return f"{layout.EXPERTS_PREFIX}{m[1]}.{m[2]}", first_expert + int(m[3])
    return None


def expert_numbers(names) -> set[int]:
    """The expert numbers that the layer names among `names` hold."""
    experts = set()
    for name in names:
        if (m := LAYER.match(name)) is None:
            continue
        if (e := SEQUENTIAL_EXPERT.match(m[2])) is not None:
            experts.add(int(e[1]))
        elif (e := GROUPED_EXPERT.match(m[2])) is not None:
            experts.add(int(e[3]))
    return experts


def where_stored(name: str, first_layer: int = 0, first_expert: int = 0) -> Where:
    """The global region a model-keyed name holds, its layer counted from `first_layer` and its expert from
    `first_expert` (those of its pipeline stage and expert-parallel rank)."""
    layer_match = LAYER.match(name)
    if layer_match is None:
        if (mtp := MTP_LAYER.match(name)) is not None:
            scope = f"mtp.layers.{mtp[1]}.transformer_layer."
            if expert := expert_number(mtp[2], first_expert):
                return scope + expert[0], None, expert[1]
            return scope + mtp[2], None, None
        return name, None, None
    layer, sub = first_layer + int(layer_match[1]), layer_match[2]
    if expert := expert_number(sub, first_expert):
        return expert[0], layer, expert[1]
    return sub, layer, None


def model_name(where: Where, grouped_experts: bool) -> str:
    """The model's own name of a global region (layers and experts numbered globally): the inverse of
    `where_stored`, an expert's name that of TEGroupedMLP (`grouped_experts`, Megatron-LM's --moe-grouped-gemm)
    or of SequentialMLP."""
    name, layer, expert = where
    if expert is not None:
        scope, _, sub = name.partition(layout.EXPERTS_PREFIX)
        name = scope + (f"mlp.experts.{sub}{expert}" if grouped_experts else f"mlp.experts.local_experts.{expert}.{sub}")
    if (mtp := MTP_LAYER.match(name)) is not None:
        name = f"mtp.layers.{mtp[1]}.mtp_model_layer.{mtp[2]}"
    return name if layer is None else f"decoder.layers.{layer}.{name}"


def piece_where(piece: Piece, key: str) -> Where:
    """The region a plan piece reads, from its torch_dist key and offsets."""
    if (m := LAYER.match(key)) is not None:  # one key per layer: offsets hold only the expert
        return m[2], int(m[1]), piece.offsets[0] if piece.offsets else None
    if key.startswith("decoder.layers."):  # stacked: offsets are (layer,) or (layer, expert)
        return key.removeprefix("decoder.layers."), piece.offsets[0], piece.offsets[1] if len(piece.offsets) > 1 else None
    return key, None, piece.offsets[0] if piece.offsets else None  # an MTP layer's expert, or a whole tensor


def spellings(name: str) -> list[str]:
    """A layer's tensor name and, for a norm that the local spec keeps as a module of its own, that module's."""
    return [name] + [local + name.removeprefix(stored) for local, stored in layout.LOCAL_SPEC_RENAMES.items() if name.startswith(stored)]


def piece_wheres(piece: Piece) -> list[tuple[str, Where]]:
    """Every region that may hold a piece, by its key: under each of its keys' names and their spellings."""
    wheres = []
    for key in piece.keys:
        name, layer, expert = piece_where(piece, key)
        wheres += [(key, (spelling, layer, expert)) for spelling in spellings(name)]
    return wheres


class ModelKeyedCheckpoint:
    """What the model-keyed formats share: an entry per stored region (`entries`, whatever a format keeps to read
    it), found for a plan piece under any of its names (`piece_wheres`)."""

    location: str
    entries: dict[Where, Any]

    def entry_shape(self, piece: Piece | None, entry: Any) -> Shape:
        """The global shape of a stored region (for `piece`, or alone when no piece reads it)."""
        raise NotImplementedError

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: Any) -> None:
        """None: the model-keyed formats' regions are not copied file to file."""
        return None

    def find(self, piece: Piece) -> tuple[str, Where, Any] | None:
        """The first of the piece's keys and spellings that this checkpoint holds, its region and entry."""
        return next(((key, where, self.entries[where]) for key, where in piece_wheres(piece) if where in self.entries), None)

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        """Global shapes in the plan's key space (a stacked key's shape as its pieces show it), and the
        regions that no piece of the plan reads, by their names, so that checking against the plan reports them."""
        shapes: dict[str, Shape] = {}
        found: set[Where] = set()
        for piece in plan.pieces:
            located = self.find(piece)
            if located is None:
                continue
            key, where, entry = located
            found.update(where for _, where in piece_wheres(piece))  # the others name the same tensor
            leading = plan.shapes[piece.key][: len(piece.offsets)]
            shape = (*leading, *self.entry_shape(piece, entry))
            if key not in shapes or shape != (*leading, *piece.layout.shape):
                shapes[key] = shape
        for where in self.entries.keys() - found:
            name, layer, expert = where
            label = name if layer is None else f"decoder.layers.{layer}.{name}" + ("" if expert is None else f" (expert {expert})")
            shapes[label] = self.entry_shape(None, self.entries[where])
        return shapes
