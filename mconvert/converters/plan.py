"""The plan of a conversion: every Megatron tensor of the checkpoint, and for each layer (and expert) of it,
the HF tensors it is made of, the transform, and how tensor parallelism chunks it.

Built from a family's table and a ModelSpec alone, before any weight is read, so that every check (missing
or extra tensors, wrong shapes, parallel sizes) happens before anything is written. Both directions of
conversion execute the same plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from mconvert.dtypes import dtype_of, is_floating
from mconvert.errors import ConversionError
from mconvert.formats.safetensors import Part, Rows
from mconvert.mappings.family import Family, active, mtp_blocks, mtp_position
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Entry, Section, Shift
from mconvert.mcore.hybrid import hybrid_layer_key, hybrid_model_key
from mconvert.mcore.layout import (
    EXPERTS_PREFIX,
    TensorLayout,
    checkpoint_names,
    extra_state_key,
    extra_state_only,
    layer_axis,
    layer_key,
    mtp_key,
    tensor_layout,
)
from mconvert.mcore.parallelism import Parallelism

# HF names `name[index]` select one slice of a tensor's first axis: one expert of a fused expert tensor.
_INDEXED = re.compile(r"^(?P<name>.+)\[(?P<index>\d+)\]$")


@dataclass(frozen=True)
class HFRef:
    """An HF tensor, or the part of it that one piece reads and writes: one slice `name[index]` of a fused
    expert tensor, or the rows of one section of a fused projection."""

    name: str
    index: Part = None

    @staticmethod
    def parse(text: str) -> HFRef:
        match = _INDEXED.match(text)
        return HFRef(match["name"], int(match["index"])) if match else HFRef(text)

    @staticmethod
    def of(entry: Entry, text: str, spec: ModelSpec) -> HFRef:
        """The HF tensor `text` names for `entry` (a Section reads only its rows)."""
        return HFRef(text, Rows(*entry.span(spec))) if isinstance(entry, Section) else HFRef.parse(text)


@dataclass(frozen=True)
class Piece:
    """One region of a Megatron tensor (a whole model tensor, or one layer's or one expert's slice of a
    stacked one) and the HF tensors it is built from."""

    keys: tuple[str, ...]  # checkpoint keys that hold this region (one, or two names of the same tensor)
    offsets: tuple[int, ...]  # leading offsets of the region: (layer,), (layer, expert), (expert,) or ()
    layout: TensorLayout
    entry: Entry
    sources: tuple[HFRef, ...]
    # HF copies of a tensor another piece writes (an MTP layer's embedding): read back, never written.
    copy: bool = False

    @property
    def key(self) -> str:
        return self.keys[0]

    def chunks(self) -> list[tuple[tuple[int, ...], slice]]:
        """(offsets within the region, slice along the split axis) of each tensor-parallel chunk."""
        shape, axis = self.layout.shape, self.layout.split_axis
        if axis is None:
            return [((0,) * len(shape), slice(None))]
        step = shape[axis] // self.layout.fragments
        return [
            (tuple(i * step if a == axis else 0 for a in range(len(shape))), slice(i * step, (i + 1) * step))
            for i in range(self.layout.fragments)
        ]


@dataclass(frozen=True)
class Plan:
    family: Family
    spec: ModelSpec
    parallelism: Parallelism
    dtype: np.dtype
    shapes: dict[str, tuple[int, ...]]  # every checkpoint key's global shape
    pieces: tuple[Piece, ...]
    extra_state_keys: tuple[str, ...]

    def dtype_of(self, piece: Piece) -> np.dtype:
        """The dtype of a piece's tensors, on both sides: the conversion's, unless the tensor has its own."""
        return piece.layout.dtype if piece.layout.dtype is not None else self.dtype

    def nbytes(self, piece: Piece) -> int:
        return math.prod(piece.layout.shape) * self.dtype_of(piece).itemsize

    def shifted_in_16_bits(self) -> list[str]:
        """The HF tensors stored as w - by (Shift) in a 16-bit dtype, where such a difference can round (bf16 w - 1
        for w outside [0.5, 2])."""
        return sorted({ref.name for piece in self.pieces if isinstance(piece.entry, Shift) and self.dtype_of(piece).itemsize == 2
                       for ref in piece.sources})

    def narrowed(self, stored: dict[str, np.dtype]) -> list[str]:
        """The HF tensors of `stored` dtypes (the source's) that the checkpoint holds in a narrower floating-point
        dtype, where their values round (an fp32 tensor in a bf16 checkpoint)."""
        return sorted({ref.name for piece in self.pieces for ref in piece.sources
                       if (source := stored.get(ref.name)) is not None and is_floating(source)
                       and source.itemsize > self.dtype_of(piece).itemsize})

    def key_dtypes(self) -> dict[str, np.dtype]:
        return {key: self.dtype_of(piece) for piece in self.pieces for key in piece.keys}

    def hf_names(self) -> set[str]:
        return {ref.name for piece in self.pieces for ref in piece.sources}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the plan reads or writes, with its shape (a tensor of which pieces fill one slice
        each, `name[index]`, spans all its slices), in the order of the pieces."""
        shapes: dict[str, tuple[int, ...]] = {}
        for piece in self.pieces:
            layout = piece.layout
            region = (layout.real_rows, *layout.shape[1:]) if layout.real_rows else layout.shape
            for ref, shape in zip(piece.sources, piece.entry.hf_shapes(region, self.spec)):
                if not isinstance(ref.index, int):  # a whole tensor, or some rows of one: its whole shape
                    shapes[ref.name] = tuple(shape)
                else:
                    slices = max(ref.index + 1, shapes.get(ref.name, (0,))[0])
                    shapes[ref.name] = (slices, *shape)
        return shapes

    def hf_groups(self) -> list[list[str]]:
        """The HF tensors in hf_shapes' order, cut wherever no piece has tensors on both sides of the cut (a
        piece builds several, such as q, k and v; a tensor of slices is built by several pieces): a file that
        breaks only between these groups is filled by whole pieces."""
        position: dict[str, int] = {}
        reach: dict[int, int] = {}  # from a piece's first tensor, the last tensor that piece joins it to
        for piece in self.pieces:
            at = [position.setdefault(ref.name, len(position)) for ref in piece.sources]
            reach[min(at)] = max(reach.get(min(at), 0), *at)
        groups: list[list[str]] = []
        end = -1
        for name, at in position.items():
            if at > end:
                groups.append([])
            groups[-1].append(name)
            end = max(end, reach.get(at, at))
        return groups


def build_plan(
    family: Family,
    spec: ModelSpec,
    parallelism: Parallelism,
    dtype: Any = None,
    fused_expert_layers: frozenset[int] | None = None,
) -> Plan:
    """`dtype`: the weights' (numpy's or torch's; default the spec's). `fused_expert_layers`: layers whose HF experts
    are stored fused (3-D tensors) rather than per expert, as an HF source has them; None for HF tensors to write,
    laid out as the family's hub checkpoints are."""
    parallelism.validate(spec)
    table = family.table
    shapes: dict[str, tuple[int, ...]] = {}
    pieces: list[Piece] = []
    # Modules that own a `_extra_state`: (module key, offsets) -> leading shape of its stacked tensors.
    modules: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    hybrid = parallelism.model_class == "hybrid"

    def model_key(name: str) -> str:
        return hybrid_model_key(name) if hybrid else name

    def located(name: str, layer: int) -> tuple[str, tuple[int, ...]]:
        return (hybrid_layer_key(name, layer, spec), ()) if hybrid else layer_key(name, layer, spec)

    def add(keys: tuple[str, ...], offsets, leading, entry: Entry, sources: list[str], copy=False, expert=False):
        layout = tensor_layout(entry, spec, parallelism, expert)
        if not copy:
            for key in keys:
                shapes.setdefault(key, (*leading, *layout.shape))
                modules[key.rsplit(".", 1)[0], offsets] = leading
        pieces.append(Piece(keys, offsets, layout, entry, tuple(HFRef.of(entry, s, spec) for s in sources), copy))

    for entry in active(table.model, spec):
        add((model_key(entry.mcore),), (), (), entry, list(entry.hf_names))
    # Multi-token prediction layers (or their blocks) follow the decoder's, in HF's numbering and here.
    for layer in range(spec.num_layers + spec.mtp_layers * mtp_blocks(spec)):
        held = table.layer(spec, layer, fused_expert_layers)
        stacked = layer_axis(spec) if layer < spec.num_layers and not hybrid else ()
        for entry in held.mtp:
            add((mtp_key(entry.mcore, mtp_position(spec, layer)[0]),), (), (), entry, [held.mtp_prefix + n for n in entry.hf_names])
        for entry in held.mtp_copies:
            add((model_key(entry.mcore),), (), (), entry, [held.mtp_prefix + n for n in entry.hf_names], copy=True)
        for entry in held.entries:
            keys = [located(name, layer) for name in checkpoint_names(entry.mcore, spec)]
            add(tuple(k for k, _ in keys), keys[0][1], stacked, entry, [held.prefix + n for n in entry.hf_names])
        for module in extra_state_only([entry.mcore for entry in held.entries]):
            key, offsets = located(module, layer)
            modules[key, offsets] = stacked
        experts = spec.moe.num_experts if held.experts else 0
        for expert in range(experts):
            for entry in held.experts:
                key, offsets = located(EXPERTS_PREFIX + entry.mcore, layer)
                sources = [held.prefix + n.format(expert=expert) for n in entry.hf_names]
                add((key,), (*offsets, expert), (*stacked, experts), entry, sources, expert=True)

    if hybrid:
        # HybridModel asks for its output layer's `_extra_state` whether or not the layer shares the embedding's
        # weight (GPTModel drops it from its sharded state dict).
        modules.setdefault(("output_layer", ()), ())
    extra_state_keys = tuple(extra_state_key(module, offsets, leading) for (module, offsets), leading in modules.items())
    return Plan(family, spec, parallelism, dtype_of(dtype) if dtype is not None else spec.dtype, shapes, tuple(pieces), extra_state_keys)


def check_sources(plan: Plan, available: dict[str, tuple[int, ...]], where) -> None:
    """Every HF tensor the plan reads exists with the shape config.json implies; none is left unread.

    `available`: HF name -> shape; `where(name)` says where a tensor is stored, for messages.
    """
    for piece in plan.pieces:
        layout = piece.layout
        region = (layout.real_rows, *layout.shape[1:]) if layout.real_rows else layout.shape
        for ref, expected in zip(piece.sources, piece.entry.hf_shapes(region, plan.spec)):
            if ref.name not in available:
                raise ConversionError(f"tensor '{ref.name}' is missing from the HF checkpoint (needed for {piece.key})")
            shape = available[ref.name]
            if isinstance(ref.index, int):
                # Indexed names are slices of fused expert tensors: one slice per expert, no more, no fewer.
                if not shape or shape[0] != plan.spec.moe.num_experts:
                    raise ConversionError(
                        f"{where(ref.name)} has shape {list(shape)}: config.json implies {plan.spec.moe.num_experts} "
                        f"experts along its first axis"
                    )
                shape = shape[1:]
            if tuple(shape) != tuple(expected):
                raise ConversionError(f"{where(ref.name)} has shape {list(shape)}, config.json implies {list(expected)}")
    unread = set(available) - plan.hf_names()
    if not plan.spec.untie_embeddings:
        # Tied checkpoints may store the output layer too; it is the embedding.
        unread.discard("lm_head.weight")
    unread = {name for name in unread if not name.endswith("rotary_emb.inv_freq") and not plan.family.table.left_out_by(name)}
    if unread:
        name = sorted(unread)[0]
        raise ConversionError(f"{where(name)} is not used by the {plan.family.name} mapping ({len(unread)} such tensors)")
