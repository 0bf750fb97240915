"""HF weights from a live megatron-core model, rank by rank: the weight-sync step of RL training, where the
trainer's TP/EP-sharded parameters are handed, HF-named and whole, to an inference engine.

Which rank holds which part of which tensor is taken from megatron-core itself (the model's
`sharded_state_dict()`: the same metadata its checkpoints are written from), so every spec and layout that
megatron-core can save is covered. The parts are gathered over the given process groups in batches of
consecutive pieces (one layer's, or one expert's, tensor each) of at most BATCH_BYTES, one broadcast per
member holding parts of a batch: a MoE layer's hundreds of small expert tensors do not each pay a collective's
latency, and memory stays at about two batches (or one piece, if larger) beyond the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from mconvert.converters.mcore_sources import piece_region, stored_key
from mconvert.converters.plan import build_plan
from mconvert.dtypes import torch_dtype
from mconvert.errors import ConversionError
from mconvert.formats.dcp import RegionIndex, region_overlap
from mconvert.mappings import get_mapping
from mconvert.mcore.layout import EXPERTS_PREFIX, MODEL_KEY_PREFIXES
from mconvert.mcore.parallelism import Parallelism

Shape = tuple[int, ...]
# Bytes of consecutive pieces gathered with one broadcast per member that holds parts of them.
BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class ShardInfo:
    """Where one local tensor of a rank lies in its global tensor (all axes, the prepended ones included:
    megatron-core's stacking axes, such as the expert index, along which the tensor has size 1)."""

    key: str
    offsets: Shape
    sizes: Shape
    dtype: torch.dtype
    global_shape: Shape


def model_sharded_state_dict(model: torch.nn.Module) -> dict:
    """megatron-core's sharded state dict of `model` with the metadata Megatron-LM gives it: a pipeline stage
    with multi-token prediction layers but no embedding ties its copy of the embedding over the data-parallel
    group named there (megatron-core 0.16.1 fails without it)."""
    from megatron.core import parallel_state

    return model.sharded_state_dict(metadata={"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)})


def local_shards(model: torch.nn.Module) -> dict[tuple[str, Shape], tuple[ShardInfo, torch.Tensor]]:
    """This rank's parameter shards, by (checkpoint key, global offsets), as megatron-core shards them."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded_state_dict = model_sharded_state_dict(model)
    apply_factories(sharded_state_dict)  # e.g. a swiglu fc1 becomes its gate and up fragments
    shards = {}
    for sharded in nested_values(sharded_state_dict):
        if not isinstance(sharded, ShardedTensor) or not sharded.key.startswith(MODEL_KEY_PREFIXES):
            continue
        sizes = (1,) * sharded.prepend_axis_num + tuple(sharded.local_shape)
        info = ShardInfo(sharded.key, tuple(sharded.global_offset), sizes, sharded.data.dtype, tuple(sharded.global_shape))
        shards[(info.key, info.offsets)] = (info, sharded.data.detach())
    return shards


def gather_hf_weights(
    model: torch.nn.Module,
    config: dict[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    expert_group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, whole tensor) for every weight of this rank's pipeline stage.

    `model` is this rank's megatron-core GPTModel (one pipeline stage, TP/EP-sharded); `config` the HF
    config.json (a dict) of the model. Tensors are gathered over `group` (default: megatron-core's tensor
    parallel group) and expert tensors over `expert_group` (default: its expert tensor-and-model parallel
    group). Every rank of those groups must call this together and iterate it to the end; each gets the same
    tensors. A piece is gathered only when the iteration reaches it, so memory stays bounded.
    """
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    if expert_group is None:
        expert_group = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False) or group
    family, spec = get_mapping(config)
    # The model's own multi-token prediction layers (none when it was built without them, whatever the config).
    spec = dataclasses.replace(spec, mtp_layers=getattr(model.config, "mtp_num_layers", None) or 0)
    plan = build_plan(family, spec, Parallelism())
    mine = local_shards(model)
    device = next(iter(mine.values()))[1].device if mine else torch.device("cpu")
    # Every rank of a group learns which member holds which shard (the lowest-ranked one, for replicas), per
    # key in an index by region: a piece looks only at the shards of its own layer and expert.
    owners: dict[int, dict[str, RegionIndex]] = {}
    shapes: dict[str, Shape] = {}
    for pg in {id(group): group, id(expert_group): expert_group}.values():
        gathered: list[list[ShardInfo]] = [[] for _ in range(dist.get_world_size(pg))]
        dist.all_gather_object(gathered, [info for info, _ in mine.values()], group=pg)
        first_holder: dict[tuple[str, Shape], tuple[ShardInfo, int]] = {}
        for member, infos in enumerate(gathered):
            for info in infos:
                first_holder.setdefault((info.key, info.offsets), (info, member))
        by_key: dict[str, RegionIndex] = {}
        for info, member in first_holder.values():
            by_key.setdefault(info.key, RegionIndex()).add(info.offsets, info.sizes, (info, member))
            shapes[info.key] = info.global_shape
        owners[id(pg)] = by_key

    batch: list[tuple[Any, str, Shape, Shape, list[tuple[ShardInfo, int]]]] = []
    batch_group, batch_bytes = None, 0
    for piece in plan.pieces:
        pg = expert_group if EXPERTS_PREFIX in piece.key else group
        key = stored_key(piece, shapes)
        if key not in shapes:
            continue  # not on this pipeline stage
        offsets, region_shape = piece_region(piece, shapes[key])
        index = owners[id(pg)].get(key)
        held = index.intersecting(offsets, region_shape) if index else []
        if not held:
            continue  # another pipeline stage's layer
        nbytes = math.prod(region_shape) * held[0][0].dtype.itemsize
        if batch and (pg is not batch_group or batch_bytes + nbytes > BATCH_BYTES):
            yield from _gathered(batch, batch_group, mine, device, spec, dtype)
            batch, batch_bytes = [], 0
        batch.append((piece, key, offsets, region_shape, held))
        batch_group, batch_bytes = pg, batch_bytes + nbytes
    if batch:
        yield from _gathered(batch, batch_group, mine, device, spec, dtype)


def _gathered(
    batch: list[tuple[Any, str, Shape, Shape, list[tuple[ShardInfo, int]]]],
    pg: dist.ProcessGroup,
    mine: dict[tuple[str, Shape], tuple[ShardInfo, torch.Tensor]],
    device: torch.device,
    spec: Any,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of a batch of pieces: every shard they need, one broadcast per (member, dtype) of the
    member's shards laid end to end, then each piece's region cut from them. Every rank of `pg` holds the same
    batch (built from the same gathered metadata), so the broadcasts match."""
    needed: dict[tuple[str, Shape], tuple[ShardInfo, int]] = {}
    for *_, held in batch:
        for info, member in held:
            needed.setdefault((info.key, info.offsets), (info, member))
    by_source: dict[tuple[int, str], list[ShardInfo]] = {}
    for info, member in needed.values():
        by_source.setdefault((member, str(info.dtype)), []).append(info)
    ranks = dist.get_process_group_ranks(pg)
    shards: dict[tuple[str, Shape], torch.Tensor] = {}
    for (member, _), infos in sorted(by_source.items()):
        counts = [math.prod(info.sizes) for info in infos]
        if ranks[member] == dist.get_rank():
            # One shard (an embedding's, a large fc1's) is sent as it is: a copy of it would add its size.
            parts = [mine[(info.key, info.offsets)][1].reshape(-1) for info in infos]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            flat = torch.empty(sum(counts), dtype=infos[0].dtype, device=device)
        dist.broadcast(flat, src=ranks[member], group=pg)
        for info, part in zip(infos, flat.split(counts)):
            shards[(info.key, info.offsets)] = part.view(info.sizes)
    for piece, key, offsets, region_shape, held in batch:
        region = torch.empty(region_shape, dtype=held[0][0].dtype, device=device)
        covered = 0
        for info, _ in held:
            in_shard, in_region = region_overlap(info.offsets, info.sizes, offsets, region_shape)
            part = shards[(info.key, info.offsets)][in_shard]
            region[in_region] = part
            covered += part.numel()
        if covered != region.numel():
            raise ConversionError(f"'{key}' at {list(piece.offsets)}: the group holds {covered} of its {region.numel()} elements (wrong process group?)")
        region = region.reshape(region_shape[len(piece.offsets) :])
        if piece.layout.real_rows is not None:
            region = region[: piece.layout.real_rows]
        # Cast after the transform, as mcore_to_hf does.
        stored = next((torch_dtype(d) for d in (piece.layout.dtype, dtype) if d is not None), region.dtype)
        for ref, tensor in zip(piece.sources, piece.entry.to_hf(region, spec)):
            yield ref.name, tensor.to(stored)
