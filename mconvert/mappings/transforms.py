"""The invertible weight transforms that mapping tables are built from.

Each entry of a table names one Megatron tensor (relative to its scope: the model, a layer or an expert),
the HF tensors it is made of, and how: `to_mcore` builds the Megatron tensor from the HF ones, `to_hf` is its
exact inverse, and `hf_shapes` says which HF shapes a given Megatron shape implies (so bad input is caught
before anything is computed). Both directions of conversion come from the same entry. `to_mcore_parts` gives
the Megatron tensor as consecutive parts along dim 0 (their concatenation is `to_mcore`'s result), so that a
writer cutting it into chunks along dim 0 (fc1's gate and up halves) need not concatenate first.

`when` names a boolean attribute of the ModelSpec that must hold for the entry to exist (a bias that only some
configs have, the output layer of an untied model). `split` declares the Megatron tensor's shape and how tensor
parallelism splits it (mconvert.mappings.splits: column, row, replicated, gated, sectioned, the vocabulary).

Tensors are numpy arrays (the converters') or torch tensors (in memory, on any device: weight sync, mcore-to-hf):
the few operations that the two spell differently are below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from mconvert import dtypes
from mconvert.mappings.splits import Split

if TYPE_CHECKING:
    from mconvert.mappings.spec import ModelSpec

Shape = tuple[int, ...]
# A numpy array or a torch tensor.
Tensor = Any


def _cat(parts: Sequence[Tensor], axis: int = 0) -> Tensor:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=axis)
    import torch

    return torch.cat(list(parts), dim=axis)


def _split(tensor: Tensor, sizes: Sequence[int], axis: int) -> list[Tensor]:
    if isinstance(tensor, np.ndarray):
        return np.split(tensor, np.cumsum(sizes)[:-1], axis=axis)
    return list(tensor.split(list(sizes), dim=axis))


def _stack(parts: Sequence[Tensor], axis: int) -> Tensor:
    if isinstance(parts[0], np.ndarray):
        return np.stack(parts, axis=axis)
    import torch

    return torch.stack(list(parts), dim=axis)


def _contiguous(tensor: Tensor) -> Tensor:
    return np.ascontiguousarray(tensor) if isinstance(tensor, np.ndarray) else tensor.contiguous()


def _transposed(tensor: Tensor) -> Tensor:
    """The last two axes swapped, contiguous: a numpy array a tile at a time (dtypes.transposed)."""
    return dtypes.transposed(tensor) if isinstance(tensor, np.ndarray) else tensor.swapaxes(-1, -2).contiguous()


def _fp32(tensor: Tensor) -> Tensor:
    return tensor.astype(np.float32) if isinstance(tensor, np.ndarray) else tensor.float()


@dataclass(frozen=True)
class Rename:
    """One HF tensor is one Megatron tensor."""

    mcore: str
    hf: str
    when: str | None = None
    split: Split = field(kw_only=True)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_shapes(self, shape: Shape, spec: ModelSpec) -> list[Shape]:
        return [shape]

    def to_mcore(self, tensors: Sequence[Tensor], spec: ModelSpec) -> Tensor:
        return tensors[0]

    def to_mcore_parts(self, tensors: Sequence[Tensor], spec: ModelSpec) -> list[Tensor]:
        return [tensors[0]]

    def to_hf(self, tensor: Tensor, spec: ModelSpec) -> list[Tensor]:
        return [tensor]


@dataclass(frozen=True)
class Concat:
    """Equal-sized HF tensors stacked along dim 0: gate and up projections into Megatron's fused fc1."""

    mcore: str
    hf_names: tuple[str, ...]
    when: str | None = None
    split: Split = field(kw_only=True)

    def hf_shapes(self, shape: Shape, spec: ModelSpec) -> list[Shape]:
        parts = len(self.hf_names)
        return [(shape[0] // parts, *shape[1:])] * parts

    def to_mcore(self, tensors: Sequence[Tensor], spec: ModelSpec) -> Tensor:
        return _cat(tensors)

    def to_mcore_parts(self, tensors: Sequence[Tensor], spec: ModelSpec) -> list[Tensor]:
        return list(tensors)

    def to_hf(self, tensor: Tensor, spec: ModelSpec) -> list[Tensor]:
        parts = len(self.hf_names)
        return [_contiguous(part) for part in _split(tensor, [tensor.shape[0] // parts] * parts, 0)]


@dataclass(frozen=True)
class QKVInterleave:
    """Separate q, k, v projections (weight or bias) into Megatron's fused linear_qkv.

    Megatron orders the fused output by query group: for each of the `ng` groups, that group's `nq/ng` query
    heads, then its key head, then its value head. Tensor parallelism then splits whole groups.

    With an output gate (`spec.attention_output_gate`) the HF query projection holds each head's query and
    gate side by side, and Megatron's group holds its query heads, then their gates, then key and value.
    """

    mcore: str
    q: str
    k: str
    v: str
    when: str | None = None
    split: Split = field(kw_only=True)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    @staticmethod
    def _rows(spec: ModelSpec) -> tuple[int, int, int]:
        """Rows of the HF q (with its gates), k and v per query group."""
        heads_per_group = spec.num_attention_heads // spec.num_query_groups
        gated = 2 if spec.attention_output_gate else 1
        return gated * heads_per_group * spec.head_dim, spec.head_dim, spec.head_dim

    @staticmethod
    def fused_rows(spec: ModelSpec) -> int:
        """Rows of Megatron's fused tensor: every query group's."""
        return spec.num_query_groups * sum(QKVInterleave._rows(spec))

    def hf_shapes(self, shape: Shape, spec: ModelSpec) -> list[Shape]:
        rest = shape[1:]
        return [(rows * spec.num_query_groups, *rest) for rows in self._rows(spec)]

    def to_mcore(self, tensors: Sequence[Tensor], spec: ModelSpec) -> Tensor:
        groups, rest = spec.num_query_groups, tensors[0].shape[1:]
        q, k, v = (t.reshape(groups, -1, *rest) for t in tensors)
        if spec.attention_output_gate:  # per head [query; gate] -> per group [queries; gates]
            heads = q.reshape(groups, -1, 2, spec.head_dim, *rest)
            q = _cat([heads[:, :, 0], heads[:, :, 1]], 1).reshape(groups, -1, *rest)
        return _cat([q, k, v], 1).reshape(-1, *rest)

    def to_mcore_parts(self, tensors: Sequence[Tensor], spec: ModelSpec) -> list[Tensor]:
        return [self.to_mcore(tensors, spec)]

    def to_hf(self, tensor: Tensor, spec: ModelSpec) -> list[Tensor]:
        groups, rest = spec.num_query_groups, tensor.shape[1:]
        q, k, v = _split(tensor.reshape(groups, -1, *rest), self._rows(spec), 1)
        if spec.attention_output_gate:
            halves = q.reshape(groups, 2, -1, spec.head_dim, *rest)
            q = _stack([halves[:, 0], halves[:, 1]], 2)
        return [_contiguous(part.reshape(-1, *rest)) for part in (q, k, v)]


@dataclass(frozen=True)
class Transpose(Rename):
    """One HF tensor that is the Megatron tensor's transpose (the last two axes): transformers' fused expert
    weights are [in, out], Megatron's linear weights [out, in]."""

    def hf_shapes(self, shape: Shape, spec: ModelSpec) -> list[Shape]:
        return [(*shape[:-2], shape[-1], shape[-2])]

    def to_mcore(self, tensors: Sequence[Tensor], spec: ModelSpec) -> Tensor:
        return _transposed(tensors[0])

    def to_mcore_parts(self, tensors: Sequence[Tensor], spec: ModelSpec) -> list[Tensor]:
        return [self.to_mcore(tensors, spec)]

    def to_hf(self, tensor: Tensor, spec: ModelSpec) -> list[Tensor]:
        return [_transposed(tensor)]


@dataclass(frozen=True)
class Deinterleave:
    """One HF tensor whose gate and up rows alternate (gpt-oss: gate at even, up at odd positions along the
    output axis) into Megatron's fc1, [gate; up]; `transposed` when the HF tensor is [in, out]."""

    mcore: str
    hf: str
    transposed: bool = False
    when: str | None = None
    split: Split = field(kw_only=True)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_shapes(self, shape: Shape, spec: ModelSpec) -> list[Shape]:
        return [(*shape[1:], shape[0]) if self.transposed else shape]

    def to_mcore(self, tensors: Sequence[Tensor], spec: ModelSpec) -> Tensor:
        return _cat(self.to_mcore_parts(tensors, spec))

    def to_mcore_parts(self, tensors: Sequence[Tensor], spec: ModelSpec) -> list[Tensor]:
        rows = _transposed(tensors[0]) if self.transposed else tensors[0]
        return [_contiguous(rows[0::2]), _contiguous(rows[1::2])]

    def to_hf(self, tensor: Tensor, spec: ModelSpec) -> list[Tensor]:
        half = tensor.shape[0] // 2
        rows = _stack([tensor[:half], tensor[half:]], 1).reshape(tensor.shape)
        return [_transposed(rows) if self.transposed else _contiguous(rows)]


# A fused HF projection's sections: (groups, ((section, rows per group), ...)). Its rows fall in `groups` equal
# groups (one per key head where the family interleaves the sections by head, else one), each made of the
# sections in order.
Sections = Callable[["ModelSpec"], tuple[int, tuple[tuple[str, int], ...]]]


@dataclass(frozen=True)
class Section(Rename):
    """A Megatron tensor that is one section of a fused HF tensor: section `section` of every group of its
    rows, in group order (`sections` says how the HF tensor is cut). Megatron-Core stores the sections of its
    own fused tensors under keys of their own (gated delta-net's in_proj and conv1d), so each section is an
    entry; the converters read and write just its rows of the HF tensor (`span`)."""

    sections: Sections | None = None
    section: str = ""

    def span(self, spec: ModelSpec) -> tuple[int, int, int]:
        """(groups, first row, end row) of this section within each group."""
        groups, sections = self.sections(spec)
        names = [name for name, _ in sections]
        start = sum(rows for _, rows in sections[: names.index(self.section)])
        return groups, start, start + sections[names.index(self.section)][1]

    def hf_shapes(self, shape: Shape, spec: ModelSpec) -> list[Shape]:
        groups, sections = self.sections(spec)
        return [(groups * sum(rows for _, rows in sections), *shape[1:])]


@dataclass(frozen=True)
class Shift(Rename):
    """One HF tensor that is the Megatron tensor plus `by` (a norm whose weight HF multiplies by as it is where
    Megatron's zero-centred norms multiply by 1 + w: by 1). Computed in fp32, which holds w - by exactly for w of
    bf16 or fp16, and rounded once, to the stored dtype, by the caller: exact there where the difference needs no
    more bits than that dtype has (by Sterbenz's lemma, for any w from by / 2 to 2 by), within its last bit
    otherwise (bf16 w - 1 for w outside [0.5, 2]: Megatron's own bf16 parameter of such a norm is that rounding)."""

    by: float = 1.0

    def to_mcore(self, tensors: Sequence[Tensor], spec: ModelSpec) -> Tensor:
        return _fp32(tensors[0]) - self.by

    def to_mcore_parts(self, tensors: Sequence[Tensor], spec: ModelSpec) -> list[Tensor]:
        return [self.to_mcore(tensors, spec)]

    def to_hf(self, tensor: Tensor, spec: ModelSpec) -> list[Tensor]:
        return [_fp32(tensor) + self.by]


Entry = Rename | Concat | QKVInterleave | Transpose | Deinterleave | Section | Shift
