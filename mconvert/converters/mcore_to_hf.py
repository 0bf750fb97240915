"""Megatron-Core checkpoint -> HF safetensors, streaming: the plan of the HF -> Megatron direction, run
backwards. Each piece (one layer's, or one expert's, region of a Megatron tensor) is read from wherever the
checkpoint stores it, turned into its HF tensors by the mapping's `to_hf`, and written at its place in the
safetensors files, whose layout was computed from the plan before any weight was read. Tensors are numpy arrays
(the state-dict API's torch tensors take the same path): the export never imports torch."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mconvert.converters.adapters import merged_with_adapter
from mconvert.converters.bridge_saves import SavedTensor, vision_tower
from mconvert.converters.quantized_export import Unquantized, quantized_export
from mconvert.converters.save_folders import RunSave, config_in_args, find_run_save, named_config
from mconvert.converters.manifest import hashed_while_written
from mconvert.converters.mcore_sources import MegatronTensors, open_megatron_checkpoint, piece_region, stored_key
from mconvert.converters.original import copied_back, original_tensors
from mconvert.converters.output import atomic_directory, check_target
from mconvert.converters.hf_to_mcore import fused_expert_layers
from mconvert.converters.parallel import Buffers, Ranks, assign, check_workers, run_pieces
from mconvert.converters.plan import HFRef, Piece, Plan, build_plan
from mconvert.converters.progress import NoProgress, Progress
from mconvert.converters.whole_export import TransformersCheck, check_stored, mtp_layers_stored, whole_export_notes
from mconvert.dtypes import cast, dtype_of
from mconvert.errors import ConversionError
from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
from mconvert.formats.quantized import quantization_config
from mconvert.formats.safetensors import Rows, SafetensorsWriter, parse_size
from mconvert.hub import HF_SIDE_FILES
from mconvert.mappings import family_for_model_size, family_for_spec, get_mapping, write_hf_config
from mconvert.mappings.family import Family
from mconvert.mappings.spec import DTYPES, ModelSpec
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import parallelism_from_args
from mconvert.megatron_lm.spec_from_args import spec_from_args

Shape = tuple[int, ...]

# Each HF file is hashed for the manifest on one core (about 1 GB/s) as it fills, so its size bounds how soon
# the last one is done: on the whole Qwen2.5-7B at 8 workers 2 GB files took 5.95-6.82 s and 5 GB ones
# 8.47-10.15 s, side by side (docs/history.md).
DEFAULT_MAX_SHARD_SIZE = "2GB"


# Fields of ModelSpec that say what the weights are; a reference config must agree with the args on them.
_WEIGHT_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
    "untie_embeddings", "qkv_bias", "linear_bias", "qk_norm", "moe",
)


def resolve_model(
    args: argparse.Namespace | None, reference: dict[str, Any] | None, location: str, model_size: str | None = None
) -> tuple[Family, ModelSpec]:
    """The family and model a checkpoint holds: from its args (the family inferred from the features they
    describe), or from a reference HF config (which then supplies what Megatron does not record, and must
    agree with the args on the weights). `model_size` (a `--model-size` value) names the family; it must
    agree with the args or the reference."""
    if reference is not None:
        family, spec = get_mapping(reference, model_size, source="--hf-config config.json")
        if args is not None:
            from_args = spec_from_args(args, family.name, vocab_size=spec.vocab_size)
            for name in _WEIGHT_FIELDS + ("vocab_size",):
                if getattr(from_args, name) != getattr(spec, name):
                    raise ConversionError(
                        f"--hf-config says {name}={getattr(spec, name)}, the checkpoint's args say {getattr(from_args, name)}"
                    )
            # The multi-token prediction layers the checkpoint was trained with (an HF config names them whether or
            # not the HF weights hold them).
            spec = dataclasses.replace(spec, mtp_layers=from_args.mtp_layers)
        return family, spec
    if args is None:
        raise ConversionError(f"{location}: no Megatron-LM args that describe the model are stored with the checkpoint: pass --hf-config")
    spec = spec_from_args(args)
    family = family_for_spec(spec)
    named = family_for_model_size(model_size) if model_size is not None else family
    if named is not family:
        raise ConversionError(
            f"--model-size '{model_size}' names family '{named.name}' but the checkpoint's args describe a {family.name} model"
        )
    return family, dataclasses.replace(spec, family=family.name)


def model_args(args: argparse.Namespace | None) -> argparse.Namespace | None:
    """The stored args where they describe the model, as Megatron-LM's always do; None where they describe none:
    ms-swift stores its own training arguments in their place and keeps the model's settings in args.json."""
    return args if getattr(args, "num_layers", None) is not None else None


def piece_hf_tensors(plan: Plan, piece: Piece, region: Any) -> list[tuple[HFRef, Any]]:
    """The HF tensors (or slices `ref.index` of them) of one piece, from its stored region."""
    if piece.layout.real_rows is not None:
        region = region[: piece.layout.real_rows]  # vocabulary padding
    dtype = plan.dtype_of(piece)  # cast after the transform: a Shift's sum is exact in the stored dtype's precision
    return [(ref, cast(tensor, dtype)) for ref, tensor in zip(piece.sources, piece.entry.to_hf(region, plan.spec))]


def hf_tensors(plan: Plan, source: MegatronTensors) -> Iterator[tuple[HFRef, Any]]:
    """Each HF tensor (or slice `ref.index` of one) of the plan, from the Megatron checkpoint, one piece at a
    time."""
    for piece in plan.pieces:
        yield from piece_hf_tensors(plan, piece, source.read_piece(piece))


def plan_export(
    source: MegatronTensors,
    reference: dict[str, Any] | None = None,
    dtype: Any = None,
    model_size: str | None = None,
    original: HFCheckpoint | None = None,
) -> tuple[Plan, dict[str, Any]]:
    """The plan of exporting `source` to HF, and the HF config.json it gets; checked against the stored
    shapes before anything is read. The experts are written fused or one by one as `original` (the checkpoint
    `--hf-config` names, where it holds tensors) stores them, else as the family's hub checkpoints do."""
    args = model_args(source.args)
    family, spec = resolve_model(args, reference, source.location, model_size)

    def experts_as(spec: ModelSpec) -> frozenset[int] | None:
        return fused_expert_layers(family, spec, original) if original is not None else None

    stored = source.weights_dtype
    if stored is not None and str(stored).removeprefix("torch.") not in DTYPES:
        raise ConversionError(
            f"{source.location}: the word embedding is stored as {str(stored).removeprefix('torch.')}, "
            f"not one of the dtypes of weights ({', '.join(DTYPES)})"
        )
    chosen = dtype if dtype is not None else stored
    # MTP layers only where the family's HF format has a place for them; a save's others are left out (whole_export).
    spec = dataclasses.replace(spec, dtype=dtype_of(chosen) if chosen is not None else spec.dtype, mtp_layers=spec.mtp_layers * bool(family.table.mtp))
    # Without Megatron-LM's args (a peer's save), a model of single-block HF layers (Nemotron-H) is a HybridModel.
    parallelism = parallelism_from_args(args) if args is not None else Parallelism(model_class="hybrid" if spec.layer_blocks else "gpt")
    plan = build_plan(family, spec, parallelism, spec.dtype, experts_as(spec))
    shapes = source.stored_shapes(plan)
    if args is None and family.table.mtp and mtp_layers_stored(shapes) != spec.mtp_layers:
        # Without args (a Megatron-Bridge save) the HF config names the MTP layers, which the checkpoint may not hold.
        spec = dataclasses.replace(spec, mtp_layers=mtp_layers_stored(shapes))
        plan = build_plan(family, spec, parallelism, spec.dtype, experts_as(spec))
        shapes = source.stored_shapes(plan)
    config = write_hf_config(family, spec)
    check_stored(plan, {key: shape for key, shape in shapes.items() if family.table.mtp or not key.startswith("mtp.")}, source.location)
    return plan, config


def row_runs(plan: Plan, piece: Piece, shape: Shape, dtype: np.dtype) -> list[tuple[int, int]] | None:
    """Each HF tensor of a piece of region `shape` (past its leading axes) as (first row, rows) of it, when each is
    a contiguous run of its rows, else None: the transform applied to a stand-in (memory allocated, never touched
    unless the transform copies, as QKV's regrouping does: such pieces are read and transformed in memory)."""
    whole = np.empty(shape, dtype=dtype)
    region = whole[: piece.layout.real_rows] if piece.layout.real_rows is not None else whole
    row = math.prod(whole.shape[1:])
    runs = []
    for tensor in piece.entry.to_hf(region, plan.spec):
        start, count = (tensor.ctypes.data - whole.ctypes.data) // dtype.itemsize, tensor.size
        if not (tensor is whole or tensor.base is whole) or tensor.ndim == 0 or not tensor.flags.c_contiguous or start % row or count % row:
            return None
        runs.append((start // row, count // row))
    return runs


def file_copies(plan: Plan, piece: Piece, source: MegatronTensors, shapes: dict[str, Shape], runs: dict) -> list[tuple[HFRef, tuple[Path, int]]] | None:
    """For a piece whose HF tensors are each a run of stored bytes (a rename, or gate and up cut from fc1,
    in the stored dtype, each within one plainly stored chunk): each HF tensor's (file, position). None
    otherwise. `runs` keeps `row_runs` by entry and shape, the same for every layer and expert."""
    if any(isinstance(ref.index, Rows) for ref in piece.sources):
        return None
    key, dtype, leading = stored_key(piece, shapes), plan.dtype_of(piece), len(piece.offsets)
    offsets, shape = piece_region(piece, shapes[key])
    if (known := (piece.entry, shape[leading:], dtype, piece.layout.real_rows)) not in runs:
        runs[known] = row_runs(plan, piece, shape[leading:], dtype)
    if runs[known] is None:
        return None
    copies = []
    for ref, (first, count) in zip(piece.sources, runs[known]):
        rows = (*offsets[:leading], offsets[leading] + first, *offsets[leading + 1 :])
        if (span := source.byte_span(key, rows, (*shape[:leading], count, *shape[leading + 1 :]), dtype)) is None:
            return None
        copies.append((ref, span))
    return copies


def piece_bytes(plan: Plan, source: MegatronTensors) -> list[int]:
    """The bytes of each piece's stored region, in the plan's order."""
    shapes = source.stored_shapes(plan)
    itemsize = (source.weights_dtype if source.weights_dtype is not None else plan.dtype).itemsize
    return [math.prod(piece_region(piece, shapes[stored_key(piece, shapes)])[1]) * itemsize for piece in plan.pieces]


def file_owners(plan: Plan, writer: SafetensorsWriter, sizes: list[int], world: int, export: Unquantized = Unquantized()) -> list[int]:
    """The rank that converts each piece: the HF files are shared out whole among the ranks, balanced by bytes,
    and a piece goes to the owner of its first HF tensor's file. A file written by one rank alone is hashed by
    it as it fills; only a file that some piece's tensors straddle (a layout not made by `Plan.hf_groups`)
    would be left for rank 0 to hash at the end."""
    file_of = [writer.places[export.held(piece.sources[0].name)][0] for piece in plan.pieces]
    files = list(writer.files)
    file_bytes = dict.fromkeys(files, 0)
    for path, size in zip(file_of, sizes):
        file_bytes[path] += size
    owner = {files[i]: rank for rank, part in enumerate(assign([file_bytes[path] for path in files], world)) for i in part}
    return [owner[path] for path in file_of]


def files_written_only_by(rank: int, plan: Plan, writer: SafetensorsWriter, owners: list[int], export: Unquantized = Unquantized()) -> list[Path]:
    """The HF files whose tensors all come from pieces of `rank` (`owners`: each piece's rank)."""
    writing: dict[Path, set[int]] = {path: set() for path in writer.files}
    for piece, owner in zip(plan.pieces, owners):
        for ref in piece.sources:
            writing[writer.places[export.held(ref.name)][0]].add(owner)
    return [path for path, ranks in writing.items() if ranks == {rank}]


def write_hf_pieces(
    plan: Plan,
    source: MegatronTensors,
    writer: SafetensorsWriter,
    workers: int,
    mine: list[int],
    sizes: list[int],
    progress: Progress,
    export: Unquantized,
) -> None:
    """Read, transform and write the pieces `mine` (indices into the plan's, of `sizes` bytes) on `workers`
    threads; each region is read into a buffer reused once its HF tensors are written (at their places: no
    order among the writers), those of `export.names` quantized. `progress` counts these pieces' HF tensors and bytes."""
    # Each file's pieces in the plan's order: the order in which the HF files are laid out, and the order in
    # which hf-to-mcore writes the chunks, so that both the reads and the writes go through the files front
    # to back.
    pieces = plan.pieces
    shapes = source.stored_shapes(plan)
    progress.start(sum(len(pieces[i].sources) for i in mine), sum(writer.nbytes(export.held(ref.name), ref.index) for i in mine for ref in pieces[i].sources))
    buffers = Buffers()

    runs: dict[tuple, list[tuple[int, int]] | None] = {}

    def load(index: int) -> tuple[np.ndarray | None, list[tuple[HFRef, np.ndarray | tuple[Path, int]]]]:
        quantized = any(ref.name in export.names for ref in pieces[index].sources)
        copies = file_copies(plan, pieces[index], source, shapes, runs) if not quantized else None
        if copies is not None:
            return None, copies
        into = buffers.take(sizes[index])
        return into, piece_hf_tensors(plan, pieces[index], source.read_piece(pieces[index], into))

    def store(worker: int, index: int, loaded: tuple[np.ndarray | None, list[tuple[HFRef, np.ndarray | tuple[Path, int]]]]) -> None:
        into, tensors = loaded
        for ref, tensor in tensors:
            if isinstance(tensor, np.ndarray):
                for name, written in export.written(ref.name, tensor, ref.index):
                    writer.write(name, written, ref.index)
            else:
                writer.copy(ref.name, ref.index, *tensor)
        if into is not None:
            buffers.give_back([into])

    def done(index: int) -> None:
        progress.advance(len(pieces[index].sources), sum(writer.nbytes(export.held(ref.name), ref.index) for ref in pieces[index].sources))

    # Each HF file is hashed while it fills (one core's SHA-256 rate each): several workers fill several
    # files side by side.
    files = [writer.weight_map[export.held(pieces[i].sources[0].name)] for i in mine]
    run_pieces(mine, [sizes[i] for i in mine], load, store, workers, done, streams=files)


@dataclass(frozen=True)
class HFExport:
    plan: Plan
    config: dict[str, Any]
    files: tuple[str, ...]
    # Tensors copied unchanged from the original checkpoint (`copied_back`: the vision tower), or the save's own
    # vision tower (`saved_beside`).
    copied: int = 0
    # Every tensor written: the plan's, those beside it (`copied`), and the scales of a quantized export.
    tensors: int = 0
    source_format: str = "torch_dist"  # the format read (MegatronTensors.format)
    # Whether the --hf-config checkpoint's weights are quantized (its quantization_config, or its text_config's),
    # where these are written unquantized and config.json leaves it out.
    dequantized: bool = False
    # The tensors written quantized, as the --hf-config checkpoint stores them (`quantize`), and how (Unquantized.what).
    quantized: int = 0
    quantized_as: str = ""
    notes: tuple[str, ...] = ()  # what the export was checked against, or why not, and what it left out (whole_export)
    run: RunSave | None = None  # where the save and its config were found (save_folders)
    saved_beside: bool = False  # whether `copied` came from the save (a vision tower), not from --hf-config


def convert_mcore_to_hf(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    *,
    iteration: int | None = None,
    hf_config_dir: str | os.PathLike | None = None,
    model_size: str | None = None,
    dtype: np.dtype | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    workers: int | None = 1,
    progress: Progress = NoProgress(),
    quantize: str | None = None, adapter: str | os.PathLike | None = None,
) -> HFExport:
    """Convert the Megatron checkpoint in `load_dir` (torch_dist or legacy torch, any TP/PP/EP) into an HF model
    directory `save_dir`: sharded safetensors, their index and config.json, plus the generation config and tokenizer
    files of `hf_config_dir` when given. `model_size` (Megatron-LM's `--model-size` values, or a family name) names the
    family; it must agree with the checkpoint's args (or `hf_config_dir`). `quantize` "as-source" writes the tensors
    that the `hf_config_dir` checkpoint stores quantized (FP8 blocks, INT4, MXFP4) so again, "fp8-block" the linear
    layers in DeepSeek-V3's FP8 blocks, whatever the source (quantized_export). `adapter`: a
    Megatron-Bridge LoRA save, merged in.

    `workers` threads convert pieces at once (None: parallel.default_workers). Started by torchrun, every rank runs this with the same
    arguments: each converts its share of the pieces into the files rank 0 laid out, and rank 0 finishes."""
    save_dir = Path(save_dir)
    shard_bytes = parse_size(max_shard_size)
    workers = check_workers(workers)
    check_target(save_dir, overwrite)
    run = find_run_save(load_dir, iteration, config=hf_config_dir is None)
    source = open_megatron_checkpoint(run.load_dir, run.iteration)
    if hf_config_dir is None:  # the config the run's records name (its tool's, or slime's args)
        run = named_config(run, config_in_args(source.args))
        hf_config_dir = run.config_dir
    reference = read_hf_config(Path(hf_config_dir), "--hf-config") if hf_config_dir is not None else None
    original = original_tensors(hf_config_dir, reference)
    plan, config = plan_export(source, reference, dtype, model_size, original)
    # A vision-language save's own vision tower (Megatron-Bridge's), else the original's copied back.
    beside = vision_tower(source, plan) or copied_back(plan.family, hf_config_dir, original)
    source = source if adapter is None else merged_with_adapter(source, adapter, plan)
    export = quantized_export(quantize, hf_config_dir, reference, plan)
    config = export.config(config)
    mtp_stored = mtp_layers_stored(source.stored_shapes(plan))

    with Ranks() as ranks, contextlib.ExitStack() as checking, atomic_directory(save_dir, overwrite, ranks) as work:
        # Rank 0 checks the HF side against transformers' class beside the writes, and before anything is finished.
        check = checking.enter_context(TransformersCheck(plan, config, [*plan.hf_shapes(), *beside])) if ranks.is_first else None
        hf_shapes = plan.hf_shapes()
        dtypes = {ref.name: plan.dtype_of(piece) for piece in plan.pieces for ref in piece.sources}
        tensors = {name: (dtypes[name], shape) for name, shape in hf_shapes.items()}
        tensors.update({name: (stored.dtype, stored.shape) for name, stored in beside.items()})
        tensors, together = export.layout(tensors, plan.hf_groups() + [[name] for name in beside])
        # No piece straddles two files: whole files are shared out among the ranks (file_owners).
        writer = SafetensorsWriter(work, tensors, shard_bytes, create=ranks.is_first, together=together)
        ranks.barrier()  # the files exist, at their full size, before any rank writes into them
        sizes = piece_bytes(plan, source)
        owners = file_owners(plan, writer, sizes, ranks.world, export)
        with contextlib.ExitStack() as hashing:
            for path in files_written_only_by(ranks.rank, plan, writer, owners, export):  # hashed as they fill
                hashing.enter_context(hashed_while_written(path, functools.partial(writer.written_prefix, path)))
            try:
                mine = [index for index, owner in enumerate(owners) if owner == ranks.rank]
                write_hf_pieces(plan, source, writer, workers, mine, sizes, progress, export)
                if ranks.is_first:
                    for name, stored in beside.items():
                        if isinstance(stored, SavedTensor):
                            writer.write(name, stored.read(), None)
                        else:
                            writer.copy(name, None, stored.file, stored.begin)
            finally:
                writer.close()
        notes = whole_export_notes(plan, check.result() if check is not None else "checked by rank 0", mtp_stored)
        if run.config_from:
            notes = (f"read {run.tool}'s save in {run.load_dir}, the model's config from {run.config_dir} ({run.config_from})", *notes)
        ranks.settle()  # every rank's tensors are on disk, and rank 0's check passed
        written = ranks.gather(writer.written)
        if ranks.is_first:
            writer.finish(written)
            (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if hf_config_dir is not None:
                for pattern in HF_SIDE_FILES:
                    for path in sorted(Path(hf_config_dir).glob(pattern)):
                        shutil.copy2(path, work / path.name)
    files = tuple(sorted(p.name for p in save_dir.iterdir()))
    dequantized = bool(quantization_config(plan.spec.hf_config)) and not export.names
    return HFExport(
        plan, config, files, copied=len(beside), tensors=len(tensors), source_format=source.format, dequantized=dequantized, quantized=len(export.names), quantized_as=export.what, notes=notes,
        run=run, saved_beside=any(isinstance(stored, SavedTensor) for stored in beside.values()),
    )
