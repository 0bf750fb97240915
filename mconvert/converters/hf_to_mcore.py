"""HF safetensors -> Megatron-Core torch_dist, streaming: one layer's tensor at a time is read, transformed,
cut into its tensor-parallel chunks and written, while a thread reads the next ones; nothing holds the whole
model."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
import torch

from mconvert.converters import launch, megatron, torch_dist
from mconvert.converters.megatron import Parallelism
from mconvert.converters.output import atomic_directory, check_target
from mconvert.converters.plan import Piece, Plan, build_plan, check_sources
from mconvert.converters.safetensors_io import HFCheckpoint, fp8_block_size, read_hf_config
from mconvert.errors import ConversionError
from mconvert.manifest import hashed_while_written
from mconvert.mappings import get_mapping
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec
from mconvert.progress import NoProgress, Progress

ARGS_SCRIPT = "megatron_args.sh"
# How much of the pieces that follow the one being written may be read and built in advance: about a layer
# of a 7B model, small next to what its largest tensors take anyway.
READ_AHEAD_BYTES = 512 << 20


@dataclass(frozen=True)
class Conversion:
    plan: Plan
    args: argparse.Namespace
    flags: list[str]
    # Multi-token prediction layers the HF checkpoint held and the conversion left out (--no-mtp).
    dropped_mtp_layers: int = 0


def mtp_layers_held(family: Family, spec: ModelSpec, names) -> int:
    """How many multi-token prediction layers (HF layers num_hidden_layers, num_hidden_layers + 1, ...) the
    checkpoint holds, told by their first own tensor. transformers drops them when it saves a model."""
    if not family.table.mtp:
        return 0
    first = family.table.mtp[0].hf_names[0]
    count = 0
    while family.table.layer_prefix.format(layer=spec.num_layers + count) + first in names:
        count += 1
    return count


def without_mtp_layers(family: Family, spec: ModelSpec, names, count: int) -> set[str]:
    """`names` less those of the first `count` multi-token prediction layers."""
    prefixes = tuple(family.table.layer_prefix.format(layer=spec.num_layers + m) for m in range(count))
    return {name for name in names if not name.startswith(prefixes)}


def fused_expert_layers(family: Family, spec: ModelSpec, hf: HFCheckpoint) -> frozenset[int]:
    """MoE layers whose experts the HF checkpoint stores fused in 3-D tensors instead of one per expert."""
    table = family.table
    if spec.moe is None or not table.fused_experts:
        return frozenset()
    fused_name = table.fused_experts[0].hf_names[0].split("[")[0]
    return frozenset(
        layer
        for layer in range(spec.num_layers + spec.mtp_layers)
        if table.layer_prefix.format(layer=layer) + fused_name in hf.tensors
    )


class ReadBuffers:
    """Memory to read HF tensors into, handed back once their piece is written and reused by later reads:
    the fresh pages of a new buffer cost the kernel a fault and a zeroing each, more than the read itself.
    A buffer serves reads of half its size or more; free ones beyond READ_AHEAD_BYTES are let go, largest
    first, so that one-off sizes (the embedding) are not kept."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [i for i, buffer in enumerate(self._free) if nbytes <= buffer.numel() <= 2 * nbytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._free = sorted(self._free + buffers, key=torch.Tensor.numel)
            while sum(buffer.numel() for buffer in self._free) > READ_AHEAD_BYTES:
                self._free.pop()


def piece_parts(piece: Piece, sources: list[torch.Tensor], spec: ModelSpec, dtype: torch.dtype) -> list[torch.Tensor]:
    """The Megatron tensor region of `piece` from its HF tensors, transformed, padded and in the target dtype,
    as consecutive parts along dim 0 (the region is their concatenation)."""
    parts = [part.to(dtype) for part in piece.entry.to_mcore_parts(sources, spec)]
    rows = sum(part.shape[0] for part in parts)
    if piece.layout.real_rows is not None and piece.layout.shape[0] > rows:
        parts.append(parts[0].new_zeros(piece.layout.shape[0] - rows, *parts[0].shape[1:]))
    return parts


def piece_tensor(piece: Piece, sources: list[torch.Tensor], spec: ModelSpec, dtype: torch.dtype) -> torch.Tensor:
    """The Megatron tensor region of `piece` from its HF tensors, as one tensor."""
    return rows_of(piece_parts(piece, sources, spec, dtype), slice(None))


def rows_of(parts: list[torch.Tensor], rows: slice) -> torch.Tensor:
    """Rows `rows` of the concatenation of `parts`: a view when one part holds them all (fc1's gate or up
    half, one TP chunk of either), a copy otherwise."""
    start, stop, _ = rows.indices(sum(part.shape[0] for part in parts))
    selected, offset = [], 0
    for part in parts:
        end = offset + part.shape[0]
        if start < end and stop > offset:
            selected.append(part[max(start - offset, 0) : min(stop, end) - offset])
        offset = end
    return selected[0] if len(selected) == 1 else torch.cat(selected)


def build_piece(
    piece: Piece, hf: HFCheckpoint, spec: ModelSpec, dtype: torch.dtype, buffers: ReadBuffers
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`piece_parts` of HF tensors read from files into reused buffers; and those buffers, to hand back once
    the region is written."""
    taken = [buffers.take(hf.nbytes(ref.name, ref.index)) for ref in piece.sources]
    sources = [hf.read(ref.name, ref.index, into) for ref, into in zip(piece.sources, taken)]
    return piece_parts(piece, sources, spec, dtype), taken


def write_piece(writer: torch_dist.DCPWriter, piece: Piece, parts: list[torch.Tensor]) -> None:
    axis = piece.layout.split_axis or 0
    # Chunks along dim 0 are cut from the parts directly; along another axis from the whole region.
    whole = parts if axis == 0 else [rows_of(parts, slice(None))]
    for offsets, part in piece.chunks():
        chunk = rows_of(whole, part) if axis == 0 else whole[0][(slice(None),) * axis + (part,)]
        for key in piece.keys:
            writer.write_chunk(key, (*piece.offsets, *offsets), chunk)


def write_pieces(plan: Plan, hf: HFCheckpoint, writer: torch_dist.DCPWriter, progress: Progress) -> None:
    """Build and write every piece of the plan. A thread reads and builds the pieces ahead of the one being
    written, so that reading overlaps writing, as far as READ_AHEAD_BYTES of pieces allow (the next piece
    always): one piece slower to build than to write (fc1) then does not stall the writes."""
    pieces = [piece for piece in plan.pieces if not piece.copy]
    sizes = [math.prod(piece.layout.shape) * plan.dtype.itemsize for piece in pieces]
    progress.start(len(pieces), sum(sizes))
    buffers = ReadBuffers()
    builder = ThreadPoolExecutor(max_workers=1)
    try:
        ahead: deque[Future[tuple[list[torch.Tensor], list[torch.Tensor]]]] = deque()
        queued = 0  # pieces handed to the builder
        queued_bytes = 0  # their sizes, less those of the pieces written
        for index, piece in enumerate(pieces):
            while queued < len(pieces) and (queued <= index + 1 or queued_bytes + sizes[queued] <= READ_AHEAD_BYTES):
                ahead.append(builder.submit(build_piece, pieces[queued], hf, plan.spec, plan.dtype_of(pieces[queued]), buffers))
                queued_bytes += sizes[queued]
                queued += 1
            parts, taken = ahead.popleft().result()
            write_piece(writer, piece, parts)
            del parts  # may be views of the buffers, which later reads overwrite
            buffers.give_back(taken)
            queued_bytes -= sizes[index]
            progress.advance(1, sizes[index])
    finally:
        builder.shutdown(cancel_futures=True)  # after a failure, read no further


def convert_hf_to_mcore(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    *,
    parallelism: Parallelism = Parallelism(),
    model_size: str | None = None,
    dtype: torch.dtype | None = None,
    transformer_impl: str = "transformer_engine",
    overwrite: bool = False,
    mtp: bool = True,
    allow_nonfinite: bool = False,
    progress: Progress = NoProgress(),
) -> Conversion:
    """Convert the HF checkpoint in `load_dir` into a torch_dist checkpoint in `save_dir` for `parallelism`.
    Multi-token prediction layers the checkpoint holds are converted, or left out with `mtp=False`. A weight
    holding NaN or Inf is an error unless `allow_nonfinite`."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    config = read_hf_config(load_dir, "--load-dir")
    family, spec = get_mapping(config, model_size, source=str(load_dir / "config.json"))
    check_target(save_dir, overwrite)
    hf = HFCheckpoint(load_dir, fp8_block_size(config), check_finite=not allow_nonfinite)
    held = mtp_layers_held(family, spec, hf.tensors)
    spec = dataclasses.replace(spec, mtp_layers=held if mtp else 0)
    plan = build_plan(family, spec, parallelism, dtype, fused_expert_layers(family, spec, hf))
    read = without_mtp_layers(family, spec, hf.tensors, held) if not mtp else hf.tensors
    check_sources(plan, {name: hf.tensors[name].shape for name in read}, hf.where)
    args = megatron.megatron_args(spec, parallelism, plan.dtype, transformer_impl, tokenizer_dir=load_dir)
    flags = megatron.megatron_flags(args)

    with atomic_directory(save_dir, overwrite) as work:
        release = work / torch_dist.RELEASE
        release.mkdir()
        writer = torch_dist.DCPWriter(release)
        try:
            with hashed_while_written(release / writer.DATA_FILE):  # for the manifest
                dtypes = plan.key_dtypes()
                for key, shape in plan.shapes.items():
                    writer.declare(key, shape, dtypes[key])
                write_pieces(plan, hf, writer, progress)
                for key in plan.extra_state_keys:
                    writer.write_object(key, torch_dist.EMPTY_EXTRA_STATE)
                writer.finish()
        except BaseException:
            writer.abort()
            raise
        torch_dist.write_common(release, args)
        (work / ARGS_SCRIPT).write_text(megatron.args_script(args, save_dir))
        launch.write_launch(work, save_dir, parallelism)
        torch_dist.write_tracker(work)
    return Conversion(plan, args, flags, dropped_mtp_layers=0 if mtp else held)
