"""A conversion written in Megatron-FSDP's fsdp_dtensor format (mconvert.mcore.fsdp_dtensor), for a run under
`--use-megatron-fsdp`, which loads no torch_dist checkpoint (measured with Megatron-LM 0.19.2: its load stops at
`state_dict['model']`, KeyError). The pieces of a plan at TP 1 are written whole under the model's own names."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Callable

from mconvert.converters.model_keyed import model_name, piece_wheres
from mconvert.converters.plan import Piece, Plan
from mconvert.errors import ConversionError
from mconvert.formats.dcp_writer import DCPWriter
from mconvert.formats.torch_save import saved_bytes
from mconvert.mappings.transforms import Section
from mconvert.mcore import fsdp_dtensor
from mconvert.mcore.checkpoint import CHECKPOINT_VERSION
from mconvert.mcore.parallelism import Parallelism

Places = Callable[[Piece], list[tuple[str, slice]]]


def plan_parallelism(run: Parallelism) -> Parallelism:
    """The plan's layout for a run at `run`: TP and EP 1 (each tensor whole), the vocabulary padded as the run's TP
    pads it."""
    divisible_by = run.make_vocab_size_divisible_by * run.tp
    return dataclasses.replace(run, tp=1, ep=1, etp=None, make_vocab_size_divisible_by=divisible_by)


def check_plan(plan: Plan) -> None:
    """Refuse a model that holds tensors megatron-core keys by section (gated delta-net's and Mamba's in_proj and
    conv1d): Megatron-FSDP stores each as its one fused parameter, whose rows follow the run's tensor-parallel ranks,
    and its load would skip the sections' names without a word."""
    sectioned = next((piece for piece in plan.pieces if isinstance(piece.entry, Section)), None)
    if sectioned is not None:
        raise ConversionError(
            f"--format {fsdp_dtensor.FORMAT}: {plan.family.name}'s {sectioned.key} is a section of a tensor that "
            "Megatron-FSDP stores fused, its rows in the run's tensor-parallel order; not written in this format"
        )


def _names(piece: Piece, grouped_experts: bool) -> list[str]:
    """The model's names of a piece under either layer spec, as torch_dist's keys are all written: a run reads its
    spec's, the rest are not read. An expert's as TEGroupedMLP (`grouped_experts`) or SequentialMLP names it."""
    return list(dict.fromkeys(model_name(where, grouped_experts) for _, where in piece_wheres(piece)))


def _places(piece: Piece, grouped_experts: bool, swiglu: bool) -> list[tuple[str, slice]]:
    rows = piece.layout.shape[0]
    return [place for name in _names(piece, grouped_experts) for place in fsdp_dtensor.stored_halves(name, rows, swiglu)]


def places_for(args: argparse.Namespace) -> Places:
    """Where the run `args` describe reads a piece: (key, rows of the piece's tensor) for each key that holds it."""
    grouped = bool(getattr(args, "moe_grouped_gemm", False))
    return functools.partial(_places, grouped_experts=grouped, swiglu=bool(args.swiglu))


def declare(writer: DCPWriter, plan: Plan, places: Places) -> None:
    for piece in (piece for piece in plan.pieces if not piece.copy):
        for key, rows in places(piece):
            shape = piece.layout.shape
            writer.declare(key, (len(range(shape[0])[rows]), *shape[1:]), plan.dtype_of(piece))


def objects(plan: Plan, args: argparse.Namespace) -> list[tuple[str, bytes]]:
    """What the checkpoint holds beside the weights, torch.save'd: the run's args, iteration 0, and Adam's step
    count at 0 for every parameter."""
    grouped = bool(getattr(args, "moe_grouped_gemm", False))
    names = dict.fromkeys(name for piece in plan.pieces if not piece.copy for name in _names(piece, grouped))
    held = [("args", args), ("checkpoint_version", CHECKPOINT_VERSION), ("iteration", 0)]
    held += [(key, 0) for name in names for key in fsdp_dtensor.step_keys(name)]
    return [(key, saved_bytes(value)) for key, value in held]
