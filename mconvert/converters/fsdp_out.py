"""A conversion written in Megatron-FSDP's fsdp_dtensor format (mconvert.mcore.fsdp_dtensor), for a run under
`--use-megatron-fsdp`, which loads no torch_dist checkpoint (measured with Megatron-LM 0.19.2: its load stops at
`state_dict['model']`, KeyError). The pieces of a plan at TP 1 are written whole under the model's own names."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from mconvert.converters.model_keyed import model_name, piece_wheres
from mconvert.converters.plan import Piece, Plan
from mconvert.errors import ConversionError
from mconvert.formats.dcp_writer import DCPWriter
from mconvert.formats.torch_save import saved_bytes
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Section
from mconvert.mcore import fsdp_dtensor
from mconvert.mcore.checkpoint import CHECKPOINT_VERSION
from mconvert.mcore.parallelism import Parallelism

# Where a piece is written: (key, rows of the piece's tensor) for each key that holds it.
Places = Callable[[Piece], list[tuple[str, slice]]]


def plan_parallelism(run: Parallelism, spec: ModelSpec) -> Parallelism:
    """The plan's layout for a run at `run`, checked: TP and EP 1 (each tensor whole), the vocabulary padded as the
    run's TP pads it."""
    if run.pp > 1:
        raise ConversionError(
            f"--format {fsdp_dtensor.FORMAT} with --pp {run.pp}: Megatron-FSDP's checkpoints name each pipeline "
            "stage's layers from 0, so the stages' layers cannot be told apart"
        )
    run.validate(spec)
    divisible_by = run.make_vocab_size_divisible_by * run.tp
    return dataclasses.replace(run, tp=1, ep=1, etp=None, make_vocab_size_divisible_by=divisible_by)


class FsdpDtensorOut:
    """What the checkpoint of `plan` holds for the run `args` describe, and where."""

    def __init__(self, plan: Plan, args: argparse.Namespace):
        # A model that holds tensors megatron-core keys by section (gated delta-net's and Mamba's in_proj and conv1d)
        # is refused: Megatron-FSDP stores each as its one fused parameter, whose rows follow the run's
        # tensor-parallel ranks, and its load would skip the sections' names without a word.
        sectioned = next((piece for piece in plan.pieces if isinstance(piece.entry, Section)), None)
        if sectioned is not None:
            raise ConversionError(
                f"--format {fsdp_dtensor.FORMAT}: {plan.family.name}'s {sectioned.key} is a section of a tensor that "
                "Megatron-FSDP stores fused, its rows in the run's tensor-parallel order; not written in this format"
            )
        self.plan, self.args = plan, args
        # An expert's name as TEGroupedMLP (Megatron-LM's --moe-grouped-gemm) or SequentialMLP gives it.
        self.grouped_experts = bool(getattr(args, "moe_grouped_gemm", False))
        self.written = [piece for piece in plan.pieces if not piece.copy]

    def names(self, piece: Piece) -> list[str]:
        """The model's names of a piece under either layer spec, as torch_dist's keys are all written: a run reads
        its spec's, the rest are not read."""
        return list(dict.fromkeys(model_name(where, self.grouped_experts) for _, where in piece_wheres(piece)))

    def places(self, piece: Piece) -> list[tuple[str, slice]]:
        rows, swiglu = piece.layout.shape[0], bool(self.args.swiglu)
        return [place for name in self.names(piece) for place in fsdp_dtensor.stored_halves(name, rows, swiglu)]

    def declare(self, writer: DCPWriter) -> None:
        for piece in self.written:
            shape = piece.layout.shape
            for key, rows in self.places(piece):
                writer.declare(key, (len(range(shape[0])[rows]), *shape[1:]), self.plan.dtype_of(piece))

    def objects(self) -> list[tuple[str, bytes]]:
        """What the checkpoint holds beside the weights, torch.save'd: the run's args, iteration 0, and Adam's step
        count at 0 for every parameter."""
        names = dict.fromkeys(name for piece in self.written for name in self.names(piece))
        held = [("args", self.args), ("checkpoint_version", CHECKPOINT_VERSION), ("iteration", 0)]
        held += [(key, 0) for name in names for key in fsdp_dtensor.step_keys(name)]
        return [(key, saved_bytes(value)) for key, value in held]
