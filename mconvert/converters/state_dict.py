"""In-memory conversion of whole state dicts, both ways, from the same plan as the file converters:
an HF state dict (HF name -> tensor) <-> a Megatron global state dict (checkpoint key -> whole tensor, layers
stacked and vocabulary padded as in a torch_dist checkpoint, i.e. what megatron-core's sharded state dict
describes once gathered)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

import torch

from mconvert.converters.hf_to_mcore import fused_expert_layers, mtp_layers_held, piece_tensor
from mconvert.converters.mcore_sources import StateDictTensors
from mconvert.converters.mcore_to_hf import hf_tensors, plan_export
from mconvert.converters.plan import build_plan, check_sources
from mconvert.dtypes import as_numpy, as_torch, torch_dtype
from mconvert.formats.safetensors import Part, Rows
from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism


class StateDictHF:
    """An HF state dict read the way the converters read HF checkpoints: by name, or one slice of a fused
    expert tensor."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.tensors = state_dict

    def where(self, name: str) -> str:
        return f"tensor '{name}' of the HF state dict"

    def read(self, name: str, index: Part = None) -> torch.Tensor:
        tensor = self.tensors[name]
        if isinstance(index, Rows):
            return index.select(tensor)
        return tensor if index is None else tensor[index]


def hf_to_mcore_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    *,
    parallelism: Parallelism = Parallelism(),
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The Megatron global state dict of an HF model (`config` is its config.json as a dict). `parallelism`
    matters only for the vocabulary padding, which Megatron makes a multiple of 128 x TP."""
    family, spec = get_mapping(config)
    hf = StateDictHF(hf_state_dict)
    spec = dataclasses.replace(spec, mtp_layers=mtp_layers_held(family, spec, hf_state_dict))
    plan = build_plan(family, spec, parallelism, dtype, fused_expert_layers=fused_expert_layers(family, spec, hf))
    check_sources(plan, {name: tuple(t.shape) for name, t in hf_state_dict.items()}, hf.where)
    dtypes = plan.key_dtypes()
    state_dict = {key: torch.zeros(shape, dtype=torch_dtype(dtypes[key])) for key, shape in plan.shapes.items()}
    for piece in filter(lambda piece: not piece.copy, plan.pieces):
        sources = [as_numpy(hf.read(ref.name, ref.index)) for ref in piece.sources]
        tensor = as_torch(piece_tensor(piece, sources, spec, plan.dtype_of(piece)))
        for key in piece.keys:
            state_dict[key][piece.offsets] = tensor
    return state_dict


def mcore_to_hf_state_dict(
    mcore_state_dict: Mapping[str, torch.Tensor],
    config: dict[str, Any] | None = None,
    *,
    args: argparse.Namespace | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The HF state dict of a Megatron global state dict, described by an HF `config` (a dict), by the
    Megatron-LM `args`, or by both (which must then agree). Vocabulary padding is cut off; a tied model has
    no `lm_head.weight`, as on the hub."""
    source = StateDictTensors(dict(mcore_state_dict), args)
    plan, _ = plan_export(source, config, dtype)
    # Experts come out one per HF tensor (the hub's layout); the sections of a fused projection are put
    # together.
    shapes, state_dict = plan.hf_shapes(), {}
    for ref, tensor in hf_tensors(plan, source):
        if isinstance(ref.index, Rows):
            whole = state_dict.setdefault(ref.name, tensor.new_zeros(shapes[ref.name]))
            grouped = whole.view(ref.index.groups, -1, *whole.shape[1:])
            grouped[:, ref.index.start : ref.index.stop] = tensor.view(ref.index.groups, -1, *whole.shape[1:])
        else:
            state_dict[ref.name] = tensor
    return state_dict
