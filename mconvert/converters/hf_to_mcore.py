"""HF safetensors -> Megatron-Core torch_dist (or Megatron-FSDP's fsdp_dtensor), streaming: one layer's tensor at a
time is read, transformed, cut into its tensor-parallel chunks and written, while a thread reads the next ones;
nothing holds the whole model."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters import fsdp_out
from mconvert.converters.bridge_layout import CONTENT_METADATA, MEGATRON_BRIDGE, MEGATRON_LM, RUN_CONFIG, VisionTower, prefixed, run_config
from mconvert.converters.manifest import hashed_while_written
from mconvert.converters.output import atomic_directory, check_target
from mconvert.converters.parallel import Buffers, Ranks, check_workers, run_pieces
from mconvert.converters.plan import Piece, Plan, build_plan, check_sources
from mconvert.converters.progress import NoProgress, Progress
from mconvert.errors import ConversionError
from mconvert.formats import dcp_writer
from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
from mconvert.formats.quantized import fp8_block_size, is_mxfp4, pack_quantized
from mconvert.formats.safetensors import Rows
from mconvert.mappings import get_mapping
from mconvert.mappings.family import Family, mtp_blocks
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Shift
from mconvert.mcore import fsdp_dtensor
from mconvert.mcore.checkpoint import EMPTY_EXTRA_STATE, RELEASE, iteration_name, write_common, write_tracker
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm import launch
from mconvert.megatron_lm.args import megatron_args
from mconvert.megatron_lm.flags import args_script, megatron_flags

ARGS_SCRIPT = "megatron_args.sh"


@dataclass(frozen=True)
class Conversion:
    plan: Plan
    args: argparse.Namespace
    flags: list[str]
    # Multi-token prediction layers the HF checkpoint held and the conversion left out (--no-mtp).
    dropped_mtp_layers: int = 0
    # What the HF checkpoint held beside the model that the family's table leaves out, with its tensor count.
    left_out: tuple[tuple[str, int], ...] = ()
    # (config.json's field, its count) where it names more multi-token prediction layers than the checkpoint holds.
    mtp_not_held: tuple[str, int] | None = None
    # HF tensors stored in a wider dtype than the checkpoint holds them in (their values round), with that dtype.
    narrowed: tuple[tuple[str, np.dtype], ...] = ()
    tensors: int = 0  # every tensor written: the plan's, and a vision tower's beside them (Megatron-Bridge's layout)


def mtp_layers_held(family: Family, spec: ModelSpec, names) -> int:
    """How many multi-token prediction layers (HF layers num_hidden_layers, num_hidden_layers + 1, ...; or the one a
    family keeps apart) the checkpoint holds, told by their first own tensor, or by any tensor under their prefix
    where the family keeps it apart or leaves them out without mapping them. transformers drops them when it saves
    a model."""
    table = family.table
    if not table.mtp and not table.mtp_left_out:
        return 0

    def held(mtp_layer: int) -> bool:
        own, _ = table.mtp_prefixes(spec.num_layers, mtp_layer * mtp_blocks(spec))  # its first block's, where several
        if table.mtp and not table.mtp_prefix:
            return own + table.mtp[0].hf_names[0] in names
        return any(name.startswith(own) for name in names)

    count = 0
    while held(count) and not (table.mtp_prefix and count == 1):  # a family keeping its MTP layer apart has one
        count += 1
    return count


def mtp_layers_named(family: Family, config: dict) -> int:
    """How many multi-token prediction layers config.json says the model has (0 where the family has no such field)."""
    field = family.table.mtp_count_field
    value = (config.get("text_config") or config).get(field) if field else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def mtp_left_out(family: Family, parallelism: Parallelism) -> str:
    """Why the family leaves out the MTP layers a checkpoint holds, for this model class ("" where it does not): a
    family whose MTP layers the table maps but GPTModel cannot build (beside sparse attention) has them as a
    HybridModel, whose MTP layers are small stacks of its own layers."""
    return "" if parallelism.model_class == "hybrid" and family.table.mtp else family.table.mtp_left_out


def without_mtp_layers(family: Family, spec: ModelSpec, names, count: int) -> set[str]:
    """`names` less those of the first `count` multi-token prediction layers."""
    hf_layers = range(count * mtp_blocks(spec))
    prefixes = tuple(prefix for m in hf_layers for prefix in family.table.mtp_prefixes(spec.num_layers, m))
    return {name for name in names if not name.startswith(prefixes)}


def fused_expert_layers(family: Family, spec: ModelSpec, hf: HFCheckpoint) -> frozenset[int]:
    """MoE layers whose experts the HF checkpoint stores fused in 3-D tensors instead of one per expert."""
    table = family.table
    if spec.moe is None or not table.fused_experts:
        return frozenset()
    fused_name = table.fused_experts[0].hf_names[0].split("[")[0]
    prefixes = [table.layer_prefix.format(layer=layer) for layer in range(spec.num_layers)]
    prefixes += [table.mtp_prefixes(spec.num_layers, m)[1] for m in range(spec.mtp_layers * mtp_blocks(spec))]
    return frozenset(layer for layer, prefix in enumerate(prefixes) if prefix + fused_name in hf.tensors)


def piece_parts(piece: Piece, sources: list[np.ndarray], spec: ModelSpec, dtype: np.dtype) -> list[np.ndarray]:
    """The Megatron tensor region of `piece` from its HF tensors, transformed, padded and in the target dtype,
    as consecutive parts along dim 0 (the region is their concatenation)."""
    parts = [part.astype(dtype, copy=False) for part in piece.entry.to_mcore_parts(sources, spec)]
    rows = sum(part.shape[0] for part in parts)
    if piece.layout.real_rows is not None and piece.layout.shape[0] > rows:
        parts.append(np.zeros((piece.layout.shape[0] - rows, *parts[0].shape[1:]), dtype=dtype))
    return parts


def piece_tensor(piece: Piece, sources: list[np.ndarray], spec: ModelSpec, dtype: np.dtype) -> np.ndarray:
    """The Megatron tensor region of `piece` from its HF tensors, as one array."""
    return rows_of(piece_parts(piece, sources, spec, dtype), slice(None))


def rows_of(parts: list[np.ndarray], rows: slice) -> np.ndarray:
    """Rows `rows` of the concatenation of `parts`: a view when one part holds them all (fc1's gate or up
    half, one TP chunk of either), a copy otherwise."""
    start, stop, _ = rows.indices(sum(part.shape[0] for part in parts))
    selected, offset = [], 0
    for part in parts:
        end = offset + part.shape[0]
        if start < end and stop > offset:
            selected.append(part[max(start - offset, 0) : min(stop, end) - offset])
        offset = end
    return selected[0] if len(selected) == 1 else np.concatenate(selected)


# A chunk copied file to file: its offsets within the piece's region, its shape, and the runs of stored HF
# bytes it is made of, in order.
FileChunk = tuple[tuple[int, ...], tuple[int, ...], list[dcp_writer.Span]]


class FileCopies:
    """Which chunks of a conversion into `target` are runs of its HF tensors' stored bytes, to be copied file to
    file: only from HF files on the target's file system, where the kernel copies (across two, the bytes would
    pass through memory after the NaN check's read, read twice)."""

    def __init__(self, hf: HFCheckpoint, spec: ModelSpec, target: Path):
        self.hf, self.spec = hf, spec
        self._device = target.stat().st_dev
        self._same_device: dict[Path, bool] = {}
        # Per (entry, source shapes, dtype): each part's (source number, first element, shape), or None. The
        # same for every layer and expert.
        self._parts: dict[tuple, list[tuple[int, int, tuple[int, ...]]] | None] = {}

    def parts(self, entry, shapes: tuple[tuple[int, ...], ...], dtype: np.dtype) -> list[tuple[int, int, tuple[int, ...]]] | None:
        """Where each part of `entry`'s result lies in its sources, when each is a contiguous view of one:
        found by applying the transform to stand-ins (memory allocated, never touched unless the transform
        copies)."""
        key = (entry, shapes, dtype)
        if key not in self._parts:
            sources = [np.empty(shape, dtype=dtype) for shape in shapes]
            found = []
            for part in entry.to_mcore_parts(sources, self.spec):
                number = next((i for i, source in enumerate(sources) if part is source or part.base is source), None)
                if number is None or part.ndim == 0 or not part.flags.c_contiguous:
                    found = None
                    break
                first = (part.ctypes.data - sources[number].ctypes.data) // dtype.itemsize
                found.append((number, first, tuple(part.shape)))
            self._parts[key] = found
        return self._parts[key]

    def chunks(self, piece: Piece, dtype: np.dtype) -> list[FileChunk] | None:
        """For a piece whose tensor-parallel chunks are each runs of its HF tensors' stored bytes (renames,
        fc1's gate and up, whole or cut into column-parallel chunks; in the stored dtype): each chunk, with its
        runs. None otherwise: QKV's regrouping, a cast, a dequantized FP8 weight, vocabulary padding and
        row-parallel cuts are built in memory."""
        layout = piece.layout
        if layout.split_axis not in (None, 0) and layout.fragments > 1 or any(isinstance(ref.index, Rows) for ref in piece.sources):
            return None  # a row-parallel cut, or sections of a fused projection (interleaved by group)
        places = [self.hf.place(ref.name, ref.index) for ref in piece.sources]
        if any(stored_dtype != dtype for _, _, _, stored_dtype in places) or any(self.hf.quantized(ref.name) for ref in piece.sources):
            return None
        for path, _, _, _ in places:
            if path not in self._same_device:
                self._same_device[path] = path.stat().st_dev == self._device
            if not self._same_device[path]:
                return None
        parts = self.parts(piece.entry, tuple(shape for _, _, shape, _ in places), dtype)
        if parts is None or any(shape[1:] != layout.shape[1:] for _, _, shape in parts) or sum(shape[0] for _, _, shape in parts) != layout.shape[0]:
            return None  # not views, or padded (the vocabulary's rows)
        row = math.prod(layout.shape[1:]) * dtype.itemsize
        chunks = []
        for offsets, cut in piece.chunks():
            start, stop, _ = (cut if layout.split_axis == 0 else slice(None)).indices(layout.shape[0])
            spans, first = [], 0
            for number, element, (count, *_) in parts:
                path, begin, _, _ = places[number]
                low, high = max(start, first), min(stop, first + count)
                if low < high:
                    spans.append((path, begin + element * dtype.itemsize + (low - first) * row, (high - low) * row))
                first += count
            chunks.append((offsets, (stop - start, *layout.shape[1:]), spans))
        return chunks


def build_piece(
    piece: Piece, hf: HFCheckpoint, spec: ModelSpec, dtype: np.dtype, buffers: Buffers, copies: FileCopies | None
) -> tuple[list[np.ndarray], list[np.ndarray]] | list[FileChunk]:
    """`piece_parts` of HF tensors read into reused buffers (FP8 weights in the piece's dtype, rounded once from fp32,
    but for a Shift, which computes in fp32), and those buffers, to hand back once the region is written; or, for a
    piece whose chunks are runs of stored bytes (`FileCopies.chunks`), those chunks, once `HFCheckpoint.check`ed."""
    chunks = copies.chunks(piece, dtype) if copies else None
    if chunks is not None:
        for ref in piece.sources:
            hf.check(ref.name, ref.index)
        return chunks
    taken = [buffers.take(hf.nbytes(ref.name, ref.index)) for ref in piece.sources]
    sources = [hf.read(ref.name, ref.index, into, None if isinstance(piece.entry, Shift) else dtype) for ref, into in zip(piece.sources, taken)]
    return piece_parts(piece, sources, spec, dtype), taken


def write_piece(writer: dcp_writer.DCPWriter, piece: Piece, parts: list[np.ndarray], stream: int = 0) -> None:
    axis = piece.layout.split_axis or 0
    # Chunks along dim 0 are cut from the parts directly; along another axis from the whole region.
    whole = parts if axis == 0 else [rows_of(parts, slice(None))]
    for offsets, part in piece.chunks():
        chunk = rows_of(whole, part) if axis == 0 else whole[0][(slice(None),) * axis + (part,)]
        for key in piece.keys:
            writer.write_chunk(key, (*piece.offsets, *offsets), chunk, stream)


def write_pieces(
    plan: Plan,
    hf: HFCheckpoint,
    writer: dcp_writer.DCPWriter,
    workers: int,
    ranks: Ranks,
    progress: Progress,
    places: fsdp_out.Places | None = None,
) -> None:
    """Build and write this rank's share of the pieces on `workers` threads, each writing its own data files.
    Pieces are read and built ahead of their writing (see parallel.run_pieces), so that reading overlaps
    writing even with one worker: one piece slower to build than to write (fc1) then does not stall the
    writes. Pieces that are copies of others (`piece.copy`) are not written. With `places`, each piece is
    written whole under the keys it names, rows of it each (mconvert.converters.fsdp_out)."""
    pieces = [piece for piece in plan.pieces if not piece.copy]
    sizes = [plan.nbytes(piece) for piece in pieces]
    mine = ranks.mine(sizes)
    progress.start(len(mine), sum(sizes[i] for i in mine))
    # Chunks copied file to file are torch_dist's; written whole under other keys, every piece is built in memory.
    buffers, copies = Buffers(), FileCopies(hf, plan.spec, writer.directory) if places is None else None

    def load(index: int) -> tuple[list[np.ndarray], list[np.ndarray]] | list[FileChunk]:
        return build_piece(pieces[index], hf, plan.spec, plan.dtype_of(pieces[index]), buffers, copies)

    def store(worker: int, index: int, built: tuple[list[np.ndarray], list[np.ndarray]] | list[FileChunk]) -> None:
        piece = pieces[index]
        if isinstance(built, list):
            for offsets, shape, spans in built:
                for key in piece.keys:
                    writer.copy_chunk(key, (*piece.offsets, *offsets), shape, spans, worker)
            return
        parts, taken = built
        if places is None:
            write_piece(writer, piece, parts, worker)
        else:
            for key, rows in places(piece):
                chunk = rows_of(parts, rows)
                writer.write_chunk(key, (0,) * chunk.ndim, chunk, worker)
        del parts, built  # may be views of the buffers, which later reads overwrite
        buffers.give_back(taken)

    run_pieces(mine, [sizes[i] for i in mine], load, store, workers, lambda index: progress.advance(1, sizes[index]))


def import_plan(
    load_dir: Path, config: dict, family: Family, spec: ModelSpec, parallelism: Parallelism, dtype: Any,
    mtp: bool, allow_nonfinite: bool,
) -> tuple[HFCheckpoint, Plan, int]:
    """The HF checkpoint in `load_dir` opened (its headers read), the plan of converting it, every tensor it holds
    checked against the plan, and how many MTP layers it holds (in the plan unless `mtp` is off or the layout
    leaves them out)."""
    hf = HFCheckpoint(load_dir, fp8_block_size(config), not allow_nonfinite, is_mxfp4(config), pack_quantized(config))
    held = mtp_layers_held(family, spec, hf.tensors)
    mtp = mtp and not mtp_left_out(family, parallelism)
    spec = dataclasses.replace(spec, mtp_layers=held if mtp else 0)
    plan = build_plan(family, spec, parallelism, dtype, fused_expert_layers(family, spec, hf))
    read = without_mtp_layers(family, spec, hf.tensors, held) if not mtp else hf.tensors
    check_sources(plan, {name: hf.tensors[name].shape for name in read}, hf.where)
    return hf, plan, held


def convert_hf_to_mcore(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    *,
    parallelism: Parallelism = Parallelism(),
    model_size: str | None = None,
    dtype: Any = None,
    transformer_impl: str = "transformer_engine",
    overwrite: bool = False,
    workers: int | None = 1,
    mtp: bool = True,
    allow_nonfinite: bool = False,
    ckpt_format: str = "torch_dist",
    layout: str = MEGATRON_LM,
    progress: Progress = NoProgress(),
) -> Conversion:
    """Convert the HF checkpoint in `load_dir` into a torch_dist checkpoint in `save_dir` for `parallelism`.
    Multi-token prediction layers the checkpoint holds are converted, or left out with `mtp=False`. A weight
    holding NaN or Inf is an error unless `allow_nonfinite`.

    `workers` threads convert pieces at once (None: parallel.default_workers), each into its own data files. Started by torchrun, every rank
    runs this with the same arguments: each writes its share of the pieces into data files of its own, and
    rank 0 merges their metadata and writes the tracker file last, once all succeeded.

    `ckpt_format` fsdp_dtensor writes what a Megatron-FSDP run at `parallelism` loads instead
    (mconvert.mcore.fsdp_dtensor): each tensor whole, from a plan at TP 1. `layout` megatron-bridge writes what
    Megatron-Bridge's vision-language model loads instead (mconvert.converters.bridge_layout)."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    config = read_hf_config(load_dir, "--load-dir")
    workers = check_workers(workers)
    family, spec = get_mapping(config, model_size, source=str(load_dir / "config.json"))
    check_target(save_dir, overwrite)
    fsdp, bridge = ckpt_format == fsdp_dtensor.FORMAT, layout == MEGATRON_BRIDGE
    if fsdp and bridge:
        raise ConversionError(f"--layout {MEGATRON_BRIDGE} writes torch_dist: --format {ckpt_format} is for Megatron-LM's layout")
    planned = fsdp_out.plan_parallelism(parallelism, spec) if fsdp else parallelism
    if bridge:  # Megatron-Bridge's model keeps the vocabulary as it is (its should_pad_vocab is off by default)
        planned = dataclasses.replace(planned, make_vocab_size_divisible_by=1)
    hf, plan, held = import_plan(load_dir, config, family, spec, planned, dtype, mtp, allow_nonfinite)
    spec = plan.spec
    tower, written = (VisionTower.of(plan, hf, str(load_dir)), prefixed(plan)) if bridge else (None, plan)
    args = megatron_args(spec, parallelism, plan.dtype, transformer_impl, tokenizer_dir=load_dir)
    if fsdp:
        args.ckpt_format = ckpt_format
    fsdp_layout = fsdp_out.FsdpDtensorOut(plan, args) if fsdp else None
    flags = megatron_flags(args)

    with Ranks() as ranks, atomic_directory(save_dir, overwrite, ranks) as work:
        release = work / (iteration_name(0) if fsdp else RELEASE)
        if ranks.is_first:
            release.mkdir()
        ranks.barrier()
        with contextlib.ExitStack() as hashing:
            # Each data file is written front to back by one thread and hashed as it fills, for the manifest.
            writer = dcp_writer.DCPWriter(
                release,
                workers,
                ranks.rank,
                follow=lambda path, written, closed: hashing.enter_context(hashed_while_written(path, written, closed)),
            )
            try:
                if fsdp_layout is None:
                    dtypes = written.key_dtypes()
                    for key, shape in written.shapes.items():
                        writer.declare(key, shape, dtypes[key])
                    if tower is not None:
                        tower.declare(writer)
                    objects = [(key, EMPTY_EXTRA_STATE) for key in (*written.extra_state_keys, *(tower.extra_state_keys() if tower else ()))]
                else:
                    fsdp_layout.declare(writer)
                    objects = fsdp_layout.objects()
                write_pieces(written, hf, writer, workers, ranks, progress, fsdp_layout.places if fsdp_layout else None)
                if ranks.is_first:
                    if tower is not None:
                        tower.write(writer, hf)
                    for key, saved in objects:
                        writer.write_object(key, saved)
            finally:
                writer.abort()  # flushed and closed before the hashing's last pass
        ranks.settle()  # every rank's chunks are on disk
        parts = ranks.gather(writer.local_part())
        if ranks.is_first:
            writer.finish(parts)
            if bridge:  # a Megatron-Bridge run's records, not Megatron-LM's args and launch scripts
                write_common(release, None, CONTENT_METADATA)
                (release / RUN_CONFIG).write_text(run_config(load_dir, parallelism))
            elif not fsdp:
                write_common(release, args)
            if not bridge:
                (work / ARGS_SCRIPT).write_text(args_script(args, save_dir))
                launch.write_launch(work, save_dir, parallelism, ckpt_format)
            write_tracker(work, 0 if fsdp else None)
    left_out: dict[str, int] = {}
    written_beside = {name for names in tower.keys.values() for name in names} if tower else set()
    for name in (name for name in hf.tensors if name not in written_beside):
        if (what := family.table.left_out_by(name)) is not None:
            left_out[what] = left_out.get(what, 0) + 1
    named = mtp_layers_named(family, config)
    narrowed = plan.narrowed({name: stored.dtype for name, stored in hf.tensors.items()})
    return Conversion(plan, args, flags, dropped_mtp_layers=held - spec.mtp_layers, left_out=tuple(left_out.items()),
                      tensors=len(written.shapes) + (len(tower.shapes) if tower else 0),
                      mtp_not_held=(family.table.mtp_count_field, named) if named > held else None,
                      narrowed=tuple((name, hf.tensors[name].dtype) for name in narrowed))
