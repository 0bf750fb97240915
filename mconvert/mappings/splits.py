"""How tensor parallelism splits each Megatron tensor, and the tensor's shape, declared on the table entry that
makes it (as Megatron-Bridge's column- and row-parallel mappings carry theirs): the tables say what megatron-core's
module does with the tensor, and mcore.layout turns that into chunks for a Parallelism.

A split's dims are read from the ModelSpec alone, so every shape is known from config.json before a byte is read.
A dim is a number, the name of a ModelSpec attribute (dotted into its parts: `moe.ffn_hidden_size`, as a table's
`when` names one), or a function of the spec for the sizes that are sums or products of several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np

if TYPE_CHECKING:
    from mconvert.mappings.spec import ModelSpec

Shape = tuple[int, ...]
Dim = int | str | Callable[["ModelSpec"], int]


def size(dim: Dim, spec: ModelSpec) -> int:
    """The size a dim names for `spec`."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, str):
        value: Any = spec
        for part in dim.split("."):
            value = getattr(value, part)
        return value
    return dim(spec)


@dataclass(frozen=True, init=False)
class Split:
    """What every kind of split holds: the tensor's dims, and its own dtype where it has one. The base splits nothing
    (every rank holds the whole tensor, as Replicated says in a table); the kinds below name the axis they split."""

    dims: tuple[Dim, ...]
    # The dtype the tensor has whatever the weights' dtype: Megatron keeps the router's expert bias in fp32 (as
    # transformers keeps e_score_correction_bias), since bf16 steps are coarser than its updates.
    dtype: np.dtype | None

    # The axis tensor parallelism splits; None: none.
    axis: ClassVar[int | None] = None
    # Equal parts of that axis, each split across the ranks on its own (rank r holds part r of each).
    halves: ClassVar[int] = 1

    def __init__(self, *dims: Dim, dtype: np.dtype | None = None):
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "dtype", dtype)

    def shape(self, spec: ModelSpec, entry: Any) -> Shape:
        """The tensor's global shape (before any vocabulary padding) for `spec`; `entry`, the table entry that
        makes it."""
        return tuple(size(dim, spec) for dim in self.dims)


class Replicated(Split):
    """Whole on every rank: norms, routers, multi-latent attention's down projections, the indexer's tensors."""


class Column(Split):
    """Split by rows, the output of a column-parallel linear layer (and the per-head tensors that follow it)."""

    axis = 0


class Row(Split):
    """Split by columns, the input of a row-parallel linear layer [out, in] (linear_proj, linear_fc2, out_proj)."""

    axis = 1


class GatedColumn(Column):
    """A gated MLP's fc1: `dims[0]` gate rows, then as many up rows, each half split as a column-parallel layer's, so
    that rank r holds [gate part r; up part r] and the stored tensor stays [gate; up] whatever TP is."""

    halves = 2

    def shape(self, spec: ModelSpec, entry: Any) -> Shape:
        rows, *rest = super().shape(spec, entry)
        return (2 * rows, *rest)


class Sectioned(Column):
    """One section of a fused projection that megatron-core stores under a key of its own (a `Section` entry),
    split by rows as the projection is: the section's rows, then `dims`."""

    def shape(self, spec: ModelSpec, entry: Any) -> Shape:
        groups, start, stop = entry.span(spec)
        return (groups * (stop - start), *super().shape(spec, entry))


class Vocabulary(Column):
    """The word embedding or the output layer: a row per token, the vocabulary padded as Megatron pads it
    (mcore.layout), split by rows."""

    def __init__(self) -> None:
        super().__init__("vocab_size", "hidden_size")


def attention_width(spec: ModelSpec) -> int:
    """The width of attention's output, all heads side by side (linear_proj's input)."""
    return spec.num_attention_heads * spec.head_dim


def expert_width(spec: ModelSpec) -> int:
    """The width routed experts read and write: the model's, or the latent width they work in where the MoE layer
    projects into one and back (megatron-core's moe_latent_size: its experts' fc1 input and fc2 output)."""
    return spec.moe.latent_size or spec.hidden_size
