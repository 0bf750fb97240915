"""A LoRA adapter's tensors under PEFT names, from a live megatron-core model that Megatron-Bridge's `LoRA` wraps:
the weight-sync step of RL with LoRA, where only the adapter goes to the inference engine (verl's
`TensorLoRARequest`, SGLang's `load_lora_adapter_from_tensors`: a dict of PEFT-named tensors and the adapter's
PEFT config).

Only the adapter's parameters are gathered: which rank holds which part of each is taken from megatron-core's
sharded state dict (`rank_export.local_shards`), each member of the group sends its adapter shards in one
broadcast, and the base weights are never read. The whole adapter (a few MB to a few hundred) is then split into
PEFT's modules by `adapters.peft_tensors`, exactly as `adapter-to-hf` splits a saved one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mconvert.converters.adapters import adapter_config, peft_tensors
from mconvert.converters.bridge_adapters import ADAPTER, LORA_A, LORA_B, LoraSettings
from mconvert.converters.rank_export import ShardInfo, local_shards
from mconvert.dtypes import as_numpy, as_torch
from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping

Shape = tuple[int, ...]


@dataclass
class GatheredAdapter:
    """The adapter's tensors, whole, as the DCP reader `peft_tensors` takes them (`shapes`, `read_region`, and
    `chunks_of`: the ranks' shards each tensor was gathered from, as a save's chunks)."""

    tensors: dict[str, torch.Tensor]
    shards: dict[str, list[tuple[Shape, Shape]]]  # key: (offsets, sizes) of each rank's shard
    directory: str = "the model's LoRA adapter"

    @property
    def shapes(self) -> dict[str, Shape]:
        return {key: tuple(t.shape) for key, t in self.tensors.items()}

    def read_region(self, key: str, offsets: Shape, sizes: Shape) -> np.ndarray:
        return as_numpy(self.tensors[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])

    def chunks_of(self, key: str, offsets: Shape, sizes: Shape) -> list[int]:
        return [n for n, (at, size) in enumerate(self.shards[key])
                if all(a < o + s and o < a + z for a, z, o, s in zip(at, size, offsets, sizes))]


def gather_adapter(model: torch.nn.Module, group: dist.ProcessGroup) -> GatheredAdapter:
    """Every adapter key (`*.adapter.linear_in.weight`, `*.adapter.linear_out.weight`) whole, on every rank of
    `group`: each member broadcasts its adapter shards laid end to end (the lowest member holding a replica)."""
    mine = {place: held for place, held in local_shards(model).items() if place[0].endswith((ADAPTER + LORA_A, ADAPTER + LORA_B))}
    members: list[list[ShardInfo]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(members, [info for info, _ in mine.values()], group=group)
    ranks = dist.get_process_group_ranks(group)
    whole: dict[str, torch.Tensor] = {}
    placed: dict[str, list[tuple[Shape, Shape]]] = {}
    sent: set[tuple[str, Shape]] = set()
    for member, infos in enumerate(members):
        by_dtype: dict[torch.dtype, list[ShardInfo]] = {}
        for info in infos:
            if (info.key, info.offsets) not in sent:
                sent.add((info.key, info.offsets))
                placed.setdefault(info.key, []).append((tuple(info.offsets), tuple(info.sizes)))
                by_dtype.setdefault(info.dtype, []).append(info)
        for dtype, shards in sorted(by_dtype.items(), key=lambda item: str(item[0])):
            counts = [math.prod(info.sizes) for info in shards]
            if ranks[member] == dist.get_rank():
                flat = torch.cat([mine[(info.key, info.offsets)][1].reshape(-1) for info in shards])
            else:
                flat = torch.empty(sum(counts), dtype=dtype)
            dist.broadcast(flat, src=ranks[member], group=group)
            for info, part in zip(shards, flat.split(counts)):
                tensor = whole.setdefault(info.key, torch.zeros(info.global_shape, dtype=dtype))
                tensor[tuple(slice(o, o + s) for o, s in zip(info.offsets, info.sizes))] = part.view(info.sizes)
    return GatheredAdapter(whole, placed)


def gather_peft_adapter(
    model: torch.nn.Module,
    config: dict[str, Any],
    lora: Any,
    *,
    group: dist.ProcessGroup | None = None,
    base_name: str = "",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The LoRA adapter of `model` as PEFT holds it: (PEFT name -> tensor, the adapter's PEFT config as
    adapter_config.json holds it).

    `model` is this rank's megatron-core GPTModel (TP-sharded, one pipeline stage) wrapped by Megatron-Bridge's `lora`
    (its `LoRA`: dim, alpha, dropout are read from it); `config` the HF config.json (a dict) of the base model,
    named `base_name` in the PEFT config. The adapter is gathered over `group` (default: megatron-core's tensor
    parallel group); every rank of it must call this together, and each gets the same tensors, in the model's dtype.
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ConversionError("gather_peft_adapter: a model of one pipeline stage only (each stage holds some layers' adapters)")
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    family, spec = get_mapping(config)
    spec = dataclasses.replace(spec, mtp_layers=0)  # peft_tensors places the decoder layers' adapters
    settings = LoraSettings(dim=int(lora.dim), alpha=float(lora.alpha), dropout=float(lora.dropout or 0.0))
    tensors, modules, params = peft_tensors(gather_adapter(model, group), family, spec, settings)  # type: ignore[arg-type]
    return {name: as_torch(t) for name, t in tensors.items()}, adapter_config(settings, modules, base_name, spec.num_layers, params)
