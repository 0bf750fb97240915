"""LoRA adapters saved by Megatron-Bridge, as HF PEFT adapters (`adapter-to-hf`) or merged into an export
(`mcore-to-hf --adapter`).

Megatron-Bridge's `LoRA` wraps a Megatron linear with a ParallelLinearAdapter whose `linear_in` is lora_A
([rank, in]) and `linear_out` lora_B ([out, rank]); its output, alpha / dim x B A x, is added to the linear's. Its
adapter-only save (`save_checkpoint` with a `peft` config) is torch_dist holding only `<module>.adapter.linear_in.weight`
and `<module>.adapter.linear_out.weight` keys, stacked over the layers as the base weights are and stored in their
global shapes, whatever the TP it was saved at; `run_config.yaml`'s `peft:` section holds the LoRA's settings.

A fused Megatron linear is several HF modules, each with an adapter of its own in PEFT: lora_B's rows split as the
base weight's rows do (the family table's entry for the weight, applied to lora_B: q/k/v by query group, fc1 in
halves), and lora_A, which reads the input they share, is each one's. PEFT's scaling is lora_alpha / r, the same
alpha / dim as Megatron-Bridge's (which has no rank-stabilized variant).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.output import atomic_directory, check_target
from mconvert.dependencies import ADAPTERS, ADAPTERS_INSTALL, require
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.hf_checkpoint import read_hf_config
from mconvert.mappings import get_mapping
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Concat, QKVInterleave, Rename
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.mcore.layout import layer_key

RUN_CONFIG = "run_config.yaml"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_A, LORA_B = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
# Megatron-Bridge's PEFT classes by their run_config `_target_`; only LoRA is exported so far.
LORA_TARGET = "megatron.bridge.peft.lora.LoRA"
# Entries whose HF tensors are row ranges of the Megatron weight (or the weight itself): lora_B splits as they do.
ROW_SPLITS = (Rename, Concat, QKVInterleave)


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA of a Megatron-Bridge run, from its run_config.yaml `peft:` section."""

    dim: int
    alpha: float
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.dim


def read_lora_settings(directory: Path, command: str) -> LoraSettings:
    require(ADAPTERS, command, ADAPTERS_INSTALL)
    import yaml

    path = directory / RUN_CONFIG
    if not path.is_file():
        raise ConversionError(f"{directory}: no {RUN_CONFIG} (Megatron-Bridge writes the LoRA's settings there)")
    try:
        run_config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    peft = run_config.get("peft") if isinstance(run_config, dict) else None
    if not isinstance(peft, dict):
        raise ConversionError(f"{path}: no peft: section (not an adapter save of a Megatron-Bridge PEFT run)")
    target = peft.get("_target_")
    if target != LORA_TARGET:
        raise ConversionError(f"{path}: peft is {target}; adapter-to-hf exports {LORA_TARGET} adapters only")
    try:
        settings = LoraSettings(dim=int(peft["dim"]), alpha=float(peft["alpha"]), dropout=float(peft.get("dropout") or 0.0))
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{path}: peft: section without a usable dim and alpha ({e!r})") from None
    if settings.dim <= 0:
        raise ConversionError(f"{path}: peft: dim is {settings.dim}")
    return settings


def _hf_modules(family: Family, spec: ModelSpec, layer: int) -> dict[str, tuple[Any, str]]:
    """Megatron module (relative to the layer) -> (its weight's table entry, the layer's HF prefix)."""
    table_layer = family.table.layer(spec, layer)
    return {
        entry.mcore.removesuffix(".weight"): (entry, table_layer.prefix)
        for entry in table_layer.entries
        if entry.mcore.endswith(".weight")
    }


def peft_tensors(
    dcp: DCPCheckpoint, family: Family, spec: ModelSpec, settings: LoraSettings
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The PEFT adapter's tensors (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`) and the HF modules
    they adapt, from the Megatron-Bridge save `dcp`; every adapter key of the save must be exported."""
    stored = {key for key in dcp.shapes if key.endswith((LORA_A, LORA_B))}
    left = set(stored)
    if not stored:
        raise ConversionError(f"{dcp.directory}: holds no LoRA adapter ('*{LORA_A}' keys)")
    if any(key.startswith("mtp.") for key in stored) or spec.layer_blocks:
        raise ConversionError(f"{dcp.directory}: adapters of multi-token prediction or hybrid layers are not exported yet")
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    for layer in range(spec.num_layers):
        for module, (entry, prefix) in _hf_modules(family, spec, layer).items():
            (a_key, offsets), (b_key, _) = layer_key(module + LORA_A, layer, spec), layer_key(module + LORA_B, layer, spec)
            if a_key not in stored and b_key not in stored:
                continue
            if ".router" in module:  # transformers' routers are modules of their own, not the nn.Linear PEFT adapts
                raise ConversionError(f"'{a_key}': adapters on the MoE router are not exported yet")
            if not isinstance(entry, ROW_SPLITS):
                raise ConversionError(
                    f"'{a_key}': PEFT holds one adapter per HF module, and {module}'s weight is not rows of HF modules ({type(entry).__name__})"
                )
            a, b = (_read_layer(dcp, key, offsets) for key in (a_key, b_key))
            left -= {a_key, b_key}
            if a.shape[0] != settings.dim or b.shape[1] != settings.dim:
                raise ConversionError(
                    f"'{a_key}' {list(a.shape)} and '{b_key}' {list(b.shape)}: not rank {settings.dim}, the dim of {RUN_CONFIG}"
                )
            out, into = entry.split.shape(spec, entry)
            if (b.shape[0], a.shape[1]) != (out, into):
                raise ConversionError(
                    f"'{a_key}' {list(a.shape)} and '{b_key}' {list(b.shape)} do not adapt a {[out, into]} weight, "
                    f"{module}'s in the --hf-config model"
                )
            for hf_name, b_part in zip(entry.hf_names, entry.to_hf(b, spec)):
                name = f"base_model.model.{prefix}{hf_name.removesuffix('.weight')}"
                tensors[f"{name}.lora_A.weight"] = a.copy()  # each module's own (safetensors stores no shared memory)
                tensors[f"{name}.lora_B.weight"] = b_part
                modules.append(f"{prefix}{hf_name.removesuffix('.weight')}")
    if left:
        key = sorted(left)[0]
        if ".experts." in key:
            raise ConversionError(f"'{key}': adapters on experts are not exported yet")
        raise ConversionError(f"'{key}': an adapter on a module that no {family.name} HF module of this model is (or its lora_A or lora_B alone)")
    return tensors, modules


def _read_layer(dcp: DCPCheckpoint, key: str, offsets: tuple[int, ...]) -> np.ndarray:
    if key not in dcp.shapes:
        raise ConversionError(f"{dcp.directory}: '{key}' is missing (its lora_A or lora_B is there)")
    shape = dcp.shapes[key]
    if len(shape) != len(offsets) + 2:
        raise ConversionError(f"{dcp.directory}: '{key}' has shape {list(shape)}, not a stack of matrices")
    region = dcp.read_region(key, (*offsets, 0, 0), (*(1,) * len(offsets), *shape[len(offsets):]))
    return region.reshape(shape[len(offsets):])


def adapter_config(settings: LoraSettings, modules: list[str], base: str, layers: int) -> dict[str, Any]:
    """PEFT's LoraConfig as it saves it: its target modules by their last names where each of the model's `layers`
    has the same ones (PEFT would put an adapter on every module of such a name), else by their whole names."""
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
        "use_rslora": False,
        "lora_dropout": settings.dropout,
        "target_modules": targets,
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
    """A Megatron checkpoint's weights with a Megatron-Bridge LoRA merged in, a piece at a time: W + alpha / dim x B A
    computed in fp32, which the export then rounds once to its dtype. Pieces the adapter does not touch are the base's."""

    base: Any  # a converters.mcore_sources.MegatronTensors
    adapter: DCPCheckpoint
    scale: float

    def __getattr__(self, name: str) -> Any:  # args, location, format, weights_dtype, stored_shapes: the base's
        return getattr(self.base, name)

    def read_piece(self, piece: Any, into: np.ndarray | None = None) -> np.ndarray:
        region = self.base.read_piece(piece, into)
        module = piece.key.removesuffix(".weight")
        if module + LORA_A not in self.adapter.shapes:
            return region
        a, b = (_read_layer(self.adapter, module + part, piece.offsets) for part in (LORA_A, LORA_B))
        f32 = np.float32
        return np.asarray(region, dtype=f32) + f32(self.scale) * (np.asarray(b, dtype=f32) @ np.asarray(a, dtype=f32))

    def byte_span(self, key: str, *region: Any) -> Any:
        return None if key.removesuffix(".weight") + LORA_A in self.adapter.shapes else self.base.byte_span(key, *region)


def merged_with_adapter(source: Any, adapter_dir: str | Path, plan: Any) -> MergedTensors:
    """`source` with the LoRA adapter saved in `adapter_dir` (Megatron-Bridge's adapter-only save) merged in; every
    adapter must be on a weight of the plan, of its shape."""
    directory = iteration_dir(Path(adapter_dir))
    if not (directory / ".metadata").is_file():
        raise ConversionError(f"--adapter {directory}: no .metadata (not a torch_dist adapter save)")
    settings, dcp = read_lora_settings(directory, "mcore-to-hf --adapter"), DCPCheckpoint(directory)
    shapes = source.stored_shapes(plan)
    adapted = {key.removesuffix(LORA_A) for key in dcp.shapes if key.endswith(LORA_A)}
    if not adapted:
        raise ConversionError(f"--adapter {directory}: holds no LoRA adapter ('*{LORA_A}' keys)")
    for module in sorted(adapted | {key.removesuffix(LORA_B) for key in dcp.shapes if key.endswith(LORA_B)}):
        weight = shapes.get(module + ".weight")
        a, b = dcp.shapes.get(module + LORA_A), dcp.shapes.get(module + LORA_B)
        if weight is None or a is None or b is None:
            raise ConversionError(f"--adapter {directory}: '{module}{LORA_A}' adapts no weight of {source.location} (or lacks its lora_A or lora_B)")
        if (a[:-2], b[:-2], b[-2], a[-1], a[-2], b[-1]) != (weight[:-2], weight[:-2], weight[-2], weight[-1], settings.dim, settings.dim):
            raise ConversionError(
                f"--adapter {directory}: '{module}' lora_A {list(a)} and lora_B {list(b)} do not adapt its weight {list(weight)} at rank {settings.dim}"
            )
    return MergedTensors(source, dcp, settings.scale)


@dataclass(frozen=True)
class AdapterExport:
    family: Family
    settings: LoraSettings
    modules: list[str]
    tensors: int


def export_adapter(
    load_dir: str | Path, save_dir: str | Path, hf_config_dir: str | Path, iteration: int | None = None, overwrite: bool = False,
    base_name: str | None = None,
) -> AdapterExport:
    """Write Megatron-Bridge's LoRA adapter save in `load_dir` as an HF PEFT adapter in `save_dir`, for the HF base
    model that `hf_config_dir` holds (or whose config.json it holds), named in the adapter's config as `base_name`
    (a hub id) or by the directory's path."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    directory = iteration_dir(load_dir, iteration)
    if not (directory / ".metadata").is_file():
        raise ConversionError(f"{directory}: no .metadata (not a torch_dist adapter save)")
    settings = read_lora_settings(directory, "adapter-to-hf")
    family, spec = get_mapping(read_hf_config(Path(hf_config_dir), "--hf-config"), source="--hf-config config.json")
    tensors, modules = peft_tensors(DCPCheckpoint(directory), family, spec, settings)
    check_target(save_dir, overwrite)
    from safetensors.numpy import save_file

    with atomic_directory(save_dir, overwrite) as work:
        save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(work / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(settings, modules, base_name or str(Path(hf_config_dir).absolute()), spec.num_layers)
        (work / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return AdapterExport(family, settings, modules, len(tensors))
