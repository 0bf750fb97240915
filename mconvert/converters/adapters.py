"""Megatron-Bridge's adapter saves (LoRA, CanonicalLoRA, DoRA; bridge_adapters reads them) as HF PEFT adapters
(`adapter-to-hf`) or merged into an export (`mcore-to-hf --adapter`).

A fused Megatron linear is several HF modules, each with an adapter of its own in PEFT. PEFT's scaling is
lora_alpha / r, the same alpha / dim as Megatron-Bridge's (which has no rank-stabilized variant); DoRA's magnitudes
are PEFT's `lora_magnitude_vector` as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.bridge_adapters import ADAPTER, ROW_SPLITS, AdapterSave, LoraSettings, merged, read_lora_settings
from mconvert.converters.expert_adapters import expert_peft_tensors
from mconvert.converters.output import atomic_directory, check_target
from mconvert.converters.save_folders import bridge_record, swift_record
from mconvert.converters.swift_adapters import LAYOUT as SWIFT
from mconvert.converters.swift_adapters import SwiftAdapterSave, read_swift_settings, swift_folder
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.hf_checkpoint import read_hf_config
from mconvert.mappings import get_mapping
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.mcore.layout import layer_key

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _hf_modules(family: Family, spec: ModelSpec, layer: int) -> dict[str, tuple[Any, str]]:
    """Megatron module (relative to the layer) -> (its weight's table entry, the layer's HF prefix)."""
    table_layer = family.table.layer(spec, layer)
    return {
        entry.mcore.removesuffix(".weight"): (entry, table_layer.prefix)
        for entry in table_layer.entries
        if entry.mcore.endswith(".weight")
    }


def peft_tensors(
    dcp: DCPCheckpoint, family: Family, spec: ModelSpec, settings: LoraSettings, tp: int | None = None
) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """The PEFT adapter's tensors (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`, DoRA's
    `...lora_magnitude_vector`), the HF modules they adapt and the fused expert parameters, from the adapter save
    `dcp` (Megatron-Bridge's, or ms-swift's by `settings.layout`, recorded at TP `tp`); every adapter key of the
    save must be exported."""
    save = SwiftAdapterSave(dcp, settings, spec, tp) if settings.layout == SWIFT else AdapterSave(dcp, settings, spec)
    if not save.stored:
        raise ConversionError(f"{dcp.directory}: holds no adapter ('{save.pattern}' keys)")
    if any(key.startswith("mtp.") for key in save.stored) or spec.layer_blocks:
        raise ConversionError(f"{dcp.directory}: adapters of multi-token prediction or hybrid layers are not exported yet")
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    params: list[str] = []
    for layer in range(spec.num_layers):
        expert_tensors, expert_params = expert_peft_tensors(save, family, spec, layer)
        tensors.update(expert_tensors)
        params += expert_params
        for module, (entry, prefix) in _hf_modules(family, spec, layer).items():
            key, offsets = layer_key(module + ".weight", layer, spec)
            key = key.removesuffix(".weight")
            if not save.has(key):
                continue
            if ".router" in module:  # transformers' routers are modules of their own, not the nn.Linear PEFT adapts
                raise ConversionError(f"'{min(k for k in save.stored if k.startswith(key))}': adapters on the MoE router are not exported yet")
            if not isinstance(entry, ROW_SPLITS):
                raise ConversionError(
                    f"'{min(k for k in save.stored if k.startswith(key))}': PEFT holds one adapter per HF module, and {module}'s weight "
                    f"is not rows of HF modules ({type(entry).__name__})"
                )
            for part in save.parts(key, offsets, entry):
                hf_module = f"{prefix}{part.hf_name.removesuffix('.weight')}"
                name = f"base_model.model.{hf_module}"
                tensors[f"{name}.lora_A.weight"] = part.a.copy()  # each module's own (safetensors stores no shared memory)
                tensors[f"{name}.lora_B.weight"] = part.b
                if part.magnitude is not None:
                    tensors[f"{name}.lora_magnitude_vector"] = part.magnitude
                modules.append(hf_module)
    if save.left:
        key = min(save.left)
        raise ConversionError(f"'{key}': an adapter on a module that no {family.name} HF module of this model is (or part of one)")
    return tensors, modules, params


def adapter_config(settings: LoraSettings, modules: list[str], base: str, layers: int, params: Sequence[str] = ()) -> dict[str, Any]:
    """PEFT's LoraConfig as it saves it: its target modules by their last names where each of the model's `layers`
    has the same ones (PEFT would put an adapter on every module of such a name), else by their whole names; the
    fused expert parameters (`params`) by their whole names."""
    by_layer: dict[str, set[str]] = {}
    for module in modules:
        layer_prefix, _, name = module.rpartition(".layers.")
        index, _, within = name.partition(".")
        by_layer.setdefault(f"{layer_prefix}.{index}", set()).add(within)
    alike = len(by_layer) == layers and len({frozenset(v) for v in by_layer.values()}) == 1
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules}) if alike and _short_names_unique(modules) else sorted(modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": settings.dim,
        "lora_alpha": settings.alpha,
        "use_rslora": settings.rslora,
        "use_dora": settings.kind == "dora",
        # PEFT's ParamWrapper refuses a dropout (it cannot apply one to x inside the experts' matmuls); dropout acts
        # in training only, so an adapter of expert parameters is written without.
        "lora_dropout": 0.0 if params else settings.dropout,
        "target_modules": targets,
        **({"target_parameters": sorted(params)} if params else {}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def _short_names_unique(modules: list[str]) -> bool:
    """Whether each module's last name says which module of a layer it is (q_proj is only ever self_attn's)."""
    within = {m.split(".layers.", 1)[-1].split(".", 1)[-1] for m in modules}
    return len({w.rsplit(".", 1)[-1] for w in within}) == len(within)


@dataclass
class MergedTensors:
    """A Megatron checkpoint's weights with a Megatron-Bridge adapter merged in, a piece at a time: each HF module's
    part of the weight merged with its adapter in fp32 (`bridge_adapters.merged`) and joined back as the table entry
    joins them, which the export then rounds once to its dtype. Pieces the adapter does not touch are the base's."""

    base: Any  # a converters.mcore_sources.MegatronTensors
    adapter: AdapterSave
    spec: ModelSpec

    def __getattr__(self, name: str) -> Any:  # args, location, format, weights_dtype, stored_shapes: the base's
        return getattr(self.base, name)

    def read_piece(self, piece: Any, into: np.ndarray | None = None) -> np.ndarray:
        region = self.base.read_piece(piece, into)
        module = piece.key.removesuffix(".weight")
        if not self.adapter.has(module):
            return region
        weights = dict(zip(piece.entry.hf_names, piece.entry.to_hf(region, self.spec)))
        for part in self.adapter.parts(module, piece.offsets, piece.entry):
            weights[part.hf_name] = merged(weights[part.hf_name], part, self.adapter.settings.scale)
        return piece.entry.to_mcore([np.asarray(weights[name], dtype=np.float32) for name in piece.entry.hf_names], self.spec)

    def byte_span(self, key: str, *region: Any) -> Any:
        return None if self.adapter.has(key.removesuffix(".weight")) else self.base.byte_span(key, *region)


def merged_with_adapter(source: Any, adapter_dir: str | Path, plan: Any) -> MergedTensors:
    """`source` with the adapter saved in `adapter_dir` (Megatron-Bridge's adapter-only save) merged in; every
    adapter must be on a weight of the plan that is rows of HF modules, of its shape."""
    directory = iteration_dir(Path(adapter_dir))
    if not (directory / ".metadata").is_file():
        raise ConversionError(f"--adapter {directory}: no .metadata (not a torch_dist adapter save)")
    settings, dcp = read_lora_settings(directory, "mcore-to-hf --adapter"), DCPCheckpoint(directory)
    save = AdapterSave(dcp, settings, plan.spec)
    if not save.stored:
        raise ConversionError(f"--adapter {directory}: holds no adapter ('*{ADAPTER}*' keys)")
    for piece in plan.pieces:
        module = piece.key.removesuffix(".weight")
        if piece.key.endswith(".weight") and not piece.copy and save.has(module):
            if not isinstance(piece.entry, ROW_SPLITS):
                raise ConversionError(f"--adapter {directory}: '{module}{ADAPTER}': {module}'s weight is not rows of HF modules")
            try:
                save.parts(module, piece.offsets, piece.entry)  # reads each adapter once up front: its shapes checked
            except ConversionError as e:
                raise ConversionError(f"--adapter {directory}: {e}") from None
    if save.left:
        raise ConversionError(f"--adapter {directory}: '{min(save.left)}' adapts no weight of {source.location}")
    return MergedTensors(source, save, plan.spec)


def recorded_base(load_dir: Path, iteration: int | None) -> tuple[str, str]:
    """(HF base model, where it is named) of an adapter save: ms-swift's args.json `model_dir` or `model`, or
    Megatron-Bridge's run_config.yaml `checkpoint.hf_source_path` or `model.hf_model_id`."""
    swift = swift_folder(load_dir, iteration)
    record = swift_record(swift) if swift is not None else bridge_record(iteration_dir(load_dir, iteration))
    if record is None:
        raise ConversionError(f"--load-dir {load_dir}: its save names no HF base model; pass --hf-config")
    return record


@dataclass(frozen=True)
class AdapterExport:
    family: Family
    settings: LoraSettings
    modules: list[str]
    params: list[str]  # fused expert parameters, PEFT's target_parameters
    tensors: int


def export_adapter(
    load_dir: str | Path, save_dir: str | Path, hf_config_dir: str | Path, iteration: int | None = None, overwrite: bool = False,
    base_name: str | None = None,
) -> AdapterExport:
    """Write Megatron-Bridge's LoRA adapter save in `load_dir` as an HF PEFT adapter in `save_dir`, for the HF base
    model that `hf_config_dir` holds (or whose config.json it holds), named in the adapter's config as `base_name`
    (a hub id) or by the directory's path."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    swift = swift_folder(load_dir, iteration)
    directory = iteration_dir(swift, None) if swift is not None else iteration_dir(load_dir, iteration)
    if not (directory / ".metadata").is_file():
        raise ConversionError(f"{directory}: no .metadata (not a torch_dist adapter save)")
    settings, tp = read_swift_settings(swift) if swift is not None else (read_lora_settings(directory, "adapter-to-hf"), None)
    family, spec = get_mapping(read_hf_config(Path(hf_config_dir), "--hf-config"), source="--hf-config config.json")
    tensors, modules, params = peft_tensors(DCPCheckpoint(directory), family, spec, settings, tp)
    check_target(save_dir, overwrite)
    from safetensors.numpy import save_file

    with atomic_directory(save_dir, overwrite) as work:
        save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(work / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(settings, modules, base_name or str(Path(hf_config_dir).absolute()), spec.num_layers, params)
        (work / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return AdapterExport(family, settings, modules, params, len(tensors))
