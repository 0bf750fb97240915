"""ms-swift's LoRA adapter saves (ms-swift 4.6 training through mcore-bridge 1.6.5), read as HF modules' adapters
(`adapter-to-hf`) and written from an HF PEFT adapter (`adapter-to-mcore --layout ms-swift`).

What the layout is, read from their code:
- ms-swift wraps the Megatron model with PEFT's LoraModel (`swift/megatron/utils/utils.py` `prepare_adapter`:
  `r=lora_rank`, `lora_alpha`, `lora_dropout`, `bias=lora_bias`, `use_rslora`, `modules_to_save`), whose
  Megatron linears become mcore-bridge's `LoraParallelLinear` (`mcore_bridge/tuners/lora.py`): PEFT's scaling,
  lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), no DoRA.
- `update_layer`: on a column-parallel linear (linear_qkv, linear_fc1) lora_A is a duplicated TELinear [r, in], the
  same on every TP rank, and lora_B a TEColumnParallelLinear [out, r] split on its rows; on a row-parallel one
  (linear_proj, linear_fc2) lora_A is a TERowParallelLinear split on its input and lora_B a duplicated TELinear.
- `sharded_state_dict` (tuners_sharded_state_dict) keys them `<linear>.lora_A.default.weight` and
  `<linear>.lora_B.default.weight`, stacked over the layers as the base weights are; it applies megatron-core's
  SwiGLU sharding to linear_fc1's base weight only, so a gated linear_fc1's lora_B is stored as each TP rank's rows
  one after the other, each rank's a gate half then an up half ([g_0; u_0; g_1; u_1; ...]): its row order depends
  on the TP the save was made at, which the stored chunks (one per rank) and args.json's
  `tensor_model_parallel_size` tell. linear_qkv's rows are whole query groups per rank: the global order.
- On routed experts (TEGroupedMLP, `moe_grouped_gemm`) each factor is a TEGroupedLinear of one gemm per local expert,
  expert TP 1 (`update_layer` refuses more); megatron-core's `_sharded_state_dict_grouped` and TEGroupedMLP key them
  `mlp.experts.experts.<linear>.lora_A.default.weight` with an expert axis after the layer axis, [L, E, r, in] and
  [L, E, out, r], each expert's lora_B whole ([gate; up] for linear_fc1): the layout of Megatron-Bridge's per-expert
  adapters, which `expert_adapters` stacks as PEFT's `target_parameters`.
- `save_mcore_checkpoint(..., peft_format=True)` (`swift/megatron/utils/megatron_lm_utils.py`,
  `_filter_adapter_state_dict`) keeps the lora_A / lora_B / modules_to_save keys alone, torch_dist in
  `checkpoint-<N>/iter_<N>/` with `common.pt` (the run's args as a Namespace: its TP and PP sizes are what
  `load_mcore_checkpoint` compares) and `latest_checkpointed_iteration.txt`; `trainers/base.py` copies the run's
  `args.json` (lora_rank, lora_alpha, use_rslora, target_modules, model, ...) into the checkpoint folder, which
  `MegatronArguments.load_args_config` reads back when the adapter is loaded with `--mcore_adapter`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.bridge_adapters import LoraSettings, Part, check_adapts, read_layer
from mconvert.converters.save_folders import SWIFT_ARGS, numbered, step_folder
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.dcp_writer import DCPWriter
from mconvert.formats.torch_save import saved_bytes
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore.checkpoint import (
    CHECKPOINT_VERSION,
    METADATA_JSON,
    TRACKER_FILE,
    iteration_name,
    write_tracker,
)
from mconvert.mcore.layout import OPTIMIZER_KEY, layer_axis, layer_key

LAYOUT = "ms-swift"
LORA_A, LORA_B = ".lora_A.default.weight", ".lora_B.default.weight"
PATTERN = "*.lora_A.default.*, *.lora_B.default.*"
# get_sharded_sd_metadata's for a run without a distributed optimizer's special sharding (torch >= 2.6)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "dp_reshardable"}
COLUMN = ("linear_qkv", "linear_fc1")  # the column-parallel linears (the rest are row-parallel: linear_proj, linear_fc2)
ITERATION = 1  # what ms-swift's own `swift export --to_mcore` saves at (save_mcore_checkpoint's default)


def swift_folder(load_dir: Path, iteration: int | None) -> Path | None:
    """The ms-swift checkpoint folder (args.json beside the tracker and `iter_*`) that `load_dir` is, is in (its
    `iter_*`) or holds as `checkpoint-<N>` (`--iteration N`'s, else the newest); None for a save of another tool."""
    if (load_dir / SWIFT_ARGS).is_file() and (load_dir / TRACKER_FILE).exists():
        return load_dir
    if load_dir.name.startswith("iter_") and (load_dir.parent / SWIFT_ARGS).is_file() and (load_dir.parent / TRACKER_FILE).exists():
        return load_dir.parent
    if load_dir.is_dir() and numbered(load_dir, "checkpoint-") and not (load_dir / TRACKER_FILE).exists():
        folder = step_folder(load_dir, "checkpoint-", iteration, LAYOUT)
        return folder if (folder / SWIFT_ARGS).is_file() else None
    return None


def read_swift_settings(folder: Path) -> tuple[LoraSettings, int | None]:
    """The LoRA settings of an ms-swift checkpoint folder's args.json, and the TP size it records (None if none)."""
    path = folder / SWIFT_ARGS
    try:
        args = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path}: not JSON ({error})") from None
    if not isinstance(args, dict) or args.get("tuner_type", args.get("train_type")) != "lora":
        tuner = args.get("tuner_type", args.get("train_type")) if isinstance(args, dict) else None
        raise ConversionError(f"{path}: tuner_type is {tuner!r}; adapter-to-hf reads ms-swift's LoRA saves (tuner_type lora)")
    if args.get("lora_bias", "none") != "none":
        raise ConversionError(f"{path}: lora_bias is {args['lora_bias']!r}; the adapter's trained biases are not exported")
    if args.get("modules_to_save"):
        raise ConversionError(f"{path}: modules_to_save is {args['modules_to_save']!r}; whole trained modules are not exported")
    try:
        settings = LoraSettings(
            dim=int(args["lora_rank"]), alpha=float(args["lora_alpha"]), dropout=float(args.get("lora_dropout") or 0.0),
            rslora=bool(args.get("use_rslora")), layout=LAYOUT,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{path}: no usable lora_rank and lora_alpha ({e!r})") from None
    if settings.dim <= 0:
        raise ConversionError(f"{path}: lora_rank is {settings.dim}")
    tp = args.get("tensor_model_parallel_size")
    return settings, int(tp) if isinstance(tp, int) else None


def gated_rows_from_ranks(b: np.ndarray, tp: int) -> np.ndarray:
    """A gated linear_fc1's lora_B as stored ([g_0; u_0; g_1; u_1; ...], each TP rank's rows) in the base weight's
    order, [gate; up]."""
    return b.reshape(tp, 2, b.shape[0] // (2 * tp), b.shape[1]).swapaxes(0, 1).reshape(b.shape)


def gated_rows_to_ranks(b: np.ndarray, tp: int) -> np.ndarray:
    """[gate; up] rows as ms-swift stores a gated linear_fc1's lora_B at TP `tp` (the inverse of the above)."""
    return b.reshape(2, tp, b.shape[0] // (2 * tp), b.shape[1]).swapaxes(0, 1).reshape(b.shape)


def is_gated_fc1(module: str, entry: Any) -> bool:
    return module.endswith("linear_fc1") and len(entry.hf_names) == 2


def check_layout(spec: ModelSpec, where: str) -> None:
    """Refuse the models whose attention mcore-bridge lays out otherwise than megatron-core (converters.swift_saves:
    the gated linear_qkv per head, the fused delta-net projections): their adapters' rows are not mapped yet."""
    if spec.attention_output_gate or spec.linear_attention is not None:
        raise ConversionError(f"{where}: ms-swift's adapters of {spec.family} models (mcore-bridge's gated attention and delta-net layouts) are not converted yet")


class SwiftAdapterSave:
    """An ms-swift adapter save, with AdapterSave's reading interface (`stored`, `left`, `has`, `parts`): each
    Megatron linear's `lora_A.default` and `lora_B.default`, as its HF modules' adapters."""

    pattern = PATTERN

    def __init__(self, dcp: DCPCheckpoint, settings: LoraSettings, spec: ModelSpec, tp: int | None = None):
        check_layout(spec, str(dcp.directory))
        self.dcp, self.settings, self.spec, self.tp = dcp, settings, spec, tp
        self.stored = {k for k in dcp.shapes if not OPTIMIZER_KEY.match(k) and (".lora_" in k or ".modules_to_save." in k)}
        self.left = set(self.stored)

    def has(self, module: str) -> bool:
        return any(key.startswith(module + ".lora_") for key in self.stored)

    def parts(self, module: str, offsets: tuple[int, ...], entry: Any) -> list[Part]:
        a_key, b_key = module + LORA_A, module + LORA_B
        a, b = read_layer(self.dcp, a_key, offsets), read_layer(self.dcp, b_key, offsets)
        self.left -= {a_key, b_key}
        dim = self.settings.dim
        if a.shape[0] != dim or b.shape[1] != dim:
            raise ConversionError(f"'{a_key}' {list(a.shape)} and '{b_key}' {list(b.shape)}: not rank {dim}, the lora_rank of {SWIFT_ARGS}")
        check_adapts(a_key, a, b_key, b, entry, self.spec, module)
        if is_gated_fc1(module, entry):
            tp = len(self.dcp.chunks_of(b_key, (*offsets, 0, 0), (*(1,) * len(offsets), *b.shape)))
            if self.tp is not None and tp != self.tp:
                raise ConversionError(
                    f"'{b_key}': stored in {tp} row blocks where {SWIFT_ARGS} records tensor_model_parallel_size "
                    f"{self.tp} (ms-swift stores one per TP rank)"
                )
            if b.shape[0] % (2 * tp):
                raise ConversionError(f"'{b_key}': {b.shape[0]} rows do not split into gate and up halves of {tp} TP ranks")
            b = gated_rows_from_ranks(b, tp)
        return [Part(hf_name, a, b_part) for hf_name, b_part in zip(entry.hf_names, entry.to_hf(b, self.spec))]


def swift_targets(modules: list[str]) -> list[str]:
    """ms-swift's target_modules: the adapted linears' own names, as its `find_all_linears` gives them."""
    order = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    names = {module.rsplit(".", 1)[-1] for module in modules}
    return sorted(names, key=lambda name: order.index(name) if name in order else len(order))


def swift_args(settings: LoraSettings, targets: list[str], tp: int, model: str) -> dict[str, Any]:
    """args.json: the LoRA fields `load_args_config` reads back (MegatronTunerMixin's), the base model and the
    parallel sizes."""
    return {
        "model": model,
        "tuner_type": "lora",
        "task_type": "causal_lm",
        "bridge_backend": "mcore-bridge",
        "target_modules": targets,
        "target_regex": None,
        "modules_to_save": [],
        "lora_rank": settings.dim,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "lora_bias": "none",
        "use_rslora": settings.rslora,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "no_save_optim": True,
        "no_save_rng": True,
    }


def check_tp(adapters: list[Any], entries: dict[str, Any], spec: ModelSpec, tp: int) -> None:
    """Each adapted linear's weight splits into `tp` ranks' shards (a gated linear_fc1's gate and up halves each)."""
    for adapter in adapters:
        entry = entries[adapter.module]
        out, into = entry.split.shape(spec, entry)
        column = adapter.module.endswith(COLUMN)
        if (out // (2 if is_gated_fc1(adapter.module, entry) else 1) if column else into) % tp:
            raise ConversionError(f"--tp {tp}: {adapter.module.rsplit('.', 1)[-1]}'s weight {[out, into]} does not split into {tp} TP ranks' shards")


def _rank_chunks(module: str, tensor: np.ndarray, factor: str, tp: int) -> list[tuple[int, np.ndarray]]:
    """(offset on the split axis, chunk) of each TP rank's shard of a lora_A or lora_B, as each rank saves it:
    lora_B of a column-parallel linear on its rows, lora_A of a row-parallel one on its input; the rest whole."""
    column = module.endswith(COLUMN)
    axis = 0 if factor == "B" and column else 1 if factor == "A" and not column else None
    if axis is None or tp == 1:
        return [(0, tensor)]
    size = tensor.shape[axis] // tp
    return [(rank * size, np.take(tensor, range(rank * size, (rank + 1) * size), axis=axis)) for rank in range(tp)]


def write_swift_adapter(work: Path, adapters: list[Any], spec: ModelSpec, entries: dict[str, Any], tp: int, args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The adapter keys as ms-swift saves them at TP `tp` in `work`: `iter_0000001/` (torch_dist, one chunk per TP
    rank's shard, common.pt with the args' Namespace), the tracker file and args.json; each key's global shape."""
    directory = work / iteration_name(ITERATION)
    directory.mkdir()
    shapes: dict[str, tuple[int, ...]] = {}
    writer = DCPWriter(directory)
    try:
        for adapter in adapters:
            lora_b = adapter.lora_b
            if is_gated_fc1(adapter.module, entries[adapter.module]):
                lora_b = gated_rows_to_ranks(lora_b, tp)
            for factor, suffix, tensor in (("A", LORA_A, adapter.lora_a), ("B", LORA_B, lora_b)):
                key, offsets = layer_key(adapter.module + suffix, adapter.layer, spec)
                if key not in shapes:
                    shapes[key] = (*layer_axis(spec)[: len(offsets)], *tensor.shape)
                    writer.declare(key, shapes[key], tensor.dtype)
                axis = 0 if factor == "B" else 1
                for offset, chunk in _rank_chunks(adapter.module, tensor, factor, tp):
                    at = [0, 0]
                    at[axis] = offset
                    writer.write_chunk(key, (*offsets, *at), np.ascontiguousarray(chunk))
        writer.finish()
    finally:
        writer.abort()
    (directory / "metadata.json").write_text(json.dumps(METADATA_JSON))
    # save_mcore_checkpoint's common state: the run's args (load_mcore_checkpoint compares their TP and PP sizes)
    # and the sharded state dict's metadata it loads with.
    common = {"args": argparse.Namespace(**args), "checkpoint_version": CHECKPOINT_VERSION, "iteration": ITERATION, "content_metadata": CONTENT_METADATA}
    (directory / "common.pt").write_bytes(saved_bytes(common, folder="common"))
    write_tracker(work, ITERATION)
    (work / SWIFT_ARGS).write_text(json.dumps(args, indent=2) + "\n")
    return shapes

