"""HF PEFT LoRA adapters as Megatron-Bridge adapter-only checkpoints (`adapter-to-mcore`): the inverse of
`adapters.py`'s export, through the same family tables.

A PEFT adapter holds `base_model.model.<HF module>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]) per
adapted HF module. Megatron-Bridge's `LoRA` puts one ParallelLinearAdapter on each Megatron linear: on a fused one
(linear_qkv, a SwiGLU linear_fc1) one lora_A for the input its HF modules share, and one lora_B whose rows are
theirs, fused as the base weight's rows are (the family table's entry, `to_mcore`). So the HF modules of one fused
linear must share lora_A; one that PEFT leaves without an adapter gets lora_B rows of zeros, which add nothing.
Adapters whose q/k/v (or gate/up) lora_A differ are refused: Megatron-Bridge 0.6.2's `CanonicalLoRA`, which keeps
one adapter per projection, is not what its own adapter loading (`AutoBridge.export_adapter_ckpt`) builds (`LoRA`
only), and it stores the gate and up adapters' lora_B through megatron-core's SwiGLU factory (it picks the factory
by the base module's name), in a row order that depends on the TP it was saved at (docs/verification.md).

The checkpoint is what Megatron-Bridge's save_checkpoint writes for a PEFT run, the adapter keys alone, in their
global shapes (stacked over the layers as the base weights are), so it loads at any TP: torch_dist in `release/`
(mconvert's DCP writer), `common.pt`, and `run_config.yaml` with the `peft:` section (the LoRA's `_target_`,
dim, alpha, dropout and target modules, as its config serializer writes them) and the parallel sizes its resume
reads from the `model:` section. PEFT's scale is lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), Megatron-Bridge's
alpha / dim: dim is r, and alpha is chosen so that the scale is the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.adapters import ADAPTER_CONFIG, _hf_modules
from mconvert.converters.bridge_adapters import ADAPTER, LORA_A, LORA_B, LORA_TARGET, ROW_SPLITS, LoraSettings
from mconvert.converters.output import atomic_directory, check_target
from mconvert.converters.save_folders import RUN_CONFIG
from mconvert.converters.swift_adapters import LAYOUT as SWIFT
from mconvert.converters.swift_adapters import check_layout, check_tp, swift_args, write_swift_adapter
from mconvert.dependencies import ADAPTERS, ADAPTERS_INSTALL, require
from mconvert.errors import ConversionError
from mconvert.formats.dcp_writer import DCPWriter
from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
from mconvert.formats.torch_save import saved_bytes
from mconvert.json_files import read_json_bytes
from mconvert.mappings import get_mapping
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore.checkpoint import (
    CHECKPOINT_VERSION,
    METADATA_JSON,
    RELEASE,
    write_tracker,
)
from mconvert.mcore.layout import layer_axis, layer_key

PEFT_PREFIX = "base_model.model."
PEFT_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# adapter_config.json settings that change what an adapter computes beyond plain LoRA (DoRA, trained biases, other
# ranks or alphas per module, whole modules trained, adapters on parameters or activated by tokens): each must be unset.
NOT_PLAIN_LORA = (
    "use_dora", "fan_in_fan_out", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save", "target_parameters",
    "layer_replication", "trainable_token_indices", "alora_invocation_tokens", "use_bdlora",
)


@dataclass(frozen=True)
class AdapterModule:
    """One Megatron linear's adapter: its lora_A and fused lora_B, at a layer."""

    layer: int
    module: str  # relative to the layer: self_attention.linear_qkv
    lora_a: np.ndarray
    lora_b: np.ndarray


def read_peft_settings(directory: Path) -> tuple[dict[str, Any], LoraSettings]:
    """adapter_config.json, and the Megatron-Bridge LoRA settings with the same scale."""
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise ConversionError(f"{directory}: no {ADAPTER_CONFIG} (not an HF PEFT adapter)")
    try:
        config = json.loads(read_json_bytes(path))
    except (ValueError, RecursionError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ConversionError(f"{path}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}; adapter-to-mcore writes LoRA adapters only")
    for name in NOT_PLAIN_LORA:
        if config.get(name):
            raise ConversionError(f"{path}: {name} is {config[name]!r}; Megatron-Bridge's LoRA has no such setting")
    if config.get("bias", "none") != "none":
        raise ConversionError(f"{path}: bias is {config['bias']!r}; Megatron-Bridge's LoRA trains no biases")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        dropout = float(config.get("lora_dropout") or 0.0)
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{path}: no usable r and lora_alpha ({e!r})") from None
    if r <= 0:
        raise ConversionError(f"{path}: r is {r}")
    # Megatron-Bridge scales by alpha / dim: rsLoRA's alpha / sqrt(r) is that with alpha x sqrt(r).
    return config, LoraSettings(dim=r, alpha=alpha * math.sqrt(r) if config.get("use_rslora") else alpha, dropout=dropout)


def read_peft_tensors(directory: Path) -> dict[str, tuple[np.ndarray | None, np.ndarray | None]]:
    """HF module -> (lora_A, lora_B) of the adapter's safetensors; any other tensor is refused."""
    checkpoint = HFCheckpoint(directory)
    pairs: dict[str, list[np.ndarray | None]] = {}
    for name in sorted(checkpoint.tensors):
        if not (name.startswith(PEFT_PREFIX) and name.endswith(PEFT_SUFFIXES)):
            raise ConversionError(f"{directory}: tensor '{name}' is not a LoRA lora_A or lora_B weight (nothing of Megatron-Bridge's LoRA holds it)")
        module, part = name[len(PEFT_PREFIX):].rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        tensor = checkpoint.read(name)
        if tensor.ndim != 2:
            raise ConversionError(f"{directory}: tensor '{name}' has shape {list(tensor.shape)}, not a matrix")
        pairs.setdefault(module, [None, None])[part == "lora_B"] = tensor
    return {module: (a, b) for module, (a, b) in pairs.items()}


def bridge_modules(
    peft: dict[str, tuple[np.ndarray | None, np.ndarray | None]], family: Family, spec: ModelSpec, settings: LoraSettings, where: Path
) -> list[AdapterModule]:
    """Each adapted Megatron linear's lora_A and fused lora_B; every HF module of the adapter must be placed."""
    left = dict(peft)
    adapters = []
    for layer in range(spec.num_layers):
        for module, (entry, prefix) in _hf_modules(family, spec, layer).items():
            names = [f"{prefix}{hf_name.removesuffix('.weight')}" for hf_name in entry.hf_names]
            present = [name for name in names if name in left]
            if not present:
                continue
            if "shared_experts" in module:  # its target name, linear_fc1 or linear_fc2, would wrap the routed experts too
                raise ConversionError(f"{where}: '{present[0]}' has an adapter: adapters on an MoE layer's shared experts are not written yet")
            if not isinstance(entry, ROW_SPLITS) or ".router" in module or ".experts." in module:
                raise ConversionError(f"{where}: '{present[0]}' has an adapter, and {module} is no Megatron linear that Megatron-Bridge's LoRA adapts as one HF module's rows (not written yet)")
            out, into = entry.split.shape(spec, entry)
            shapes = entry.hf_shapes((out, settings.dim), spec)
            pairs = {name: left.pop(name) for name in present}
            for name, (a, b) in pairs.items():
                if a is None or b is None:
                    raise ConversionError(f"{where}: '{PEFT_PREFIX}{name}' has {'no lora_A' if a is None else 'no lora_B'}")
            lora_a = pairs[present[0]][0]
            parts = []
            for name, shape in zip(names, shapes):
                if name not in pairs:  # no adapter in PEFT: rows of zeros, which add nothing
                    parts.append(np.zeros(shape, dtype=lora_a.dtype))
                    continue
                a, b = pairs[name]
                if a.shape != (settings.dim, into) or b.shape != shape:
                    raise ConversionError(
                        f"{where}: '{PEFT_PREFIX}{name}' lora_A {list(a.shape)} and lora_B {list(b.shape)} do not adapt a "
                        f"{[shape[0], into]} weight at r={settings.dim}, its shape in the --hf-config model"
                    )
                if not np.array_equal(a, lora_a):
                    raise ConversionError(
                        f"{where}: '{PEFT_PREFIX}{name}.lora_A.weight' differs from '{PEFT_PREFIX}{present[0]}.lora_A.weight': "
                        f"Megatron-Bridge's LoRA on the fused {module.rsplit('.', 1)[-1]} shares one lora_A between them"
                    )
                parts.append(b.astype(lora_a.dtype, copy=False))
            adapters.append(AdapterModule(layer, module, lora_a, np.asarray(entry.to_mcore(parts, spec))))
    if left:
        name = min(left)
        raise ConversionError(f"{where}: '{PEFT_PREFIX}{name}' adapts a module that is no linear Megatron-Bridge's LoRA adapts in a {family.name} model")
    if not adapters:
        raise ConversionError(f"{where}: holds no LoRA adapter tensors")
    return adapters


def in_every_layer(adapters: list[AdapterModule], family: Family, spec: ModelSpec) -> list[AdapterModule]:
    """`adapters` and, for each adapted kind of linear, an adapter of zeros (lora_A and lora_B) in each layer that has
    that linear and no adapter on it. Megatron-Bridge's LoRA wraps a target linear in every layer, and megatron-core's
    load checks that a stacked key is asked for whole; zeros have no effect, and no gradient moves them."""
    kinds = {adapter.module for adapter in adapters}
    have = {(adapter.layer, adapter.module) for adapter in adapters}
    first = {adapter.module: adapter for adapter in reversed(adapters)}
    filled = list(adapters)
    for layer in range(spec.num_layers):
        for module in _hf_modules(family, spec, layer):
            if module in kinds and (layer, module) not in have:
                a, b = first[module].lora_a, first[module].lora_b
                filled.append(AdapterModule(layer, module, np.zeros_like(a), np.zeros_like(b)))
    return sorted(filled, key=lambda adapter: adapter.layer)


def target_modules(adapters: list[AdapterModule]) -> list[str]:
    """Megatron-Bridge's target_modules: the adapted linears' own names (its LoRA wraps them in every layer)."""
    return sorted({adapter.module.rsplit(".", 1)[-1] for adapter in adapters}, key=_bridge_order)


def _bridge_order(module: str) -> int:
    order = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    return next((i for i, name in enumerate(order) if module.endswith(name)), len(order))


def run_config(settings: LoraSettings, targets: list[str], tp: int) -> dict[str, Any]:
    """run_config.yaml: the `peft:` section (Megatron-Bridge's LoRA fields its adapter loading reads) and the parallel
    sizes its resume compares with the run's."""
    alpha: float | int = int(settings.alpha) if float(settings.alpha).is_integer() else settings.alpha
    peft = {"_target_": LORA_TARGET, "dim": settings.dim, "alpha": alpha, "dropout": settings.dropout, "target_modules": targets}
    return {"model": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1}, "peft": peft}


def write_adapter_checkpoint(release: Path, adapters: list[AdapterModule], spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The adapter keys as torch_dist in `release`, one chunk per layer; returns each key's global shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    writer = DCPWriter(release)
    try:
        for adapter in adapters:
            for suffix, tensor in ((LORA_A, adapter.lora_a), (LORA_B, adapter.lora_b)):
                key, offsets = layer_key(adapter.module + ADAPTER + suffix, adapter.layer, spec)
                if key not in shapes:
                    shapes[key] = (*layer_axis(spec)[: len(offsets)], *tensor.shape)
                    writer.declare(key, shapes[key], tensor.dtype)
                writer.write_chunk(key, (*offsets, 0, 0), np.ascontiguousarray(tensor))
        writer.finish()
    finally:
        writer.abort()
    (release / "metadata.json").write_text(json.dumps(METADATA_JSON))
    (release / "common.pt").write_bytes(saved_bytes({"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, folder="common"))
    return shapes


@dataclass(frozen=True)
class AdapterImport:
    family: Family
    settings: LoraSettings
    targets: list[str]
    keys: dict[str, tuple[int, ...]]


def import_adapter(
    adapter_dir: str | Path, save_dir: str | Path, hf_config_dir: str | Path, tp: int = 1, overwrite: bool = False,
    layout: str = "megatron-bridge", base_name: str | None = None,
) -> AdapterImport:
    """Write the HF PEFT LoRA adapter in `adapter_dir`, of the HF model whose config.json `hf_config_dir` holds, as a
    Megatron-Bridge adapter-only checkpoint in `save_dir` (or, with `layout` "ms-swift", as ms-swift's adapter save:
    converters.swift_adapters), recorded as saved at TP `tp`; ms-swift's args.json names the base `base_name` (a hub
    id) or the directory's path."""
    require(ADAPTERS, "adapter-to-mcore", ADAPTERS_INSTALL)
    import yaml

    adapter_dir, save_dir = Path(adapter_dir), Path(save_dir)
    if tp < 1:
        raise ConversionError(f"--tp {tp}: not a tensor-parallel size")
    config, settings = read_peft_settings(adapter_dir)
    if layout == SWIFT:  # ms-swift's LoRA is PEFT's: the same r, lora_alpha and rsLoRA
        settings = dataclasses.replace(settings, alpha=float(config["lora_alpha"]), rslora=bool(config.get("use_rslora")), layout=SWIFT)
    family, spec = get_mapping(read_hf_config(Path(hf_config_dir), "--hf-config"), source="--hf-config config.json")
    if spec.layer_blocks:
        raise ConversionError(f"--hf-config {hf_config_dir}: adapters of hybrid models' layers are not written yet")
    if layout == SWIFT:
        check_layout(spec, f"--hf-config {hf_config_dir}")
    adapters = in_every_layer(bridge_modules(read_peft_tensors(adapter_dir), family, spec, settings, adapter_dir), family, spec)
    targets = target_modules(adapters)
    if layout == SWIFT:
        entries = {module: entry for adapter in adapters for module, (entry, _) in _hf_modules(family, spec, adapter.layer).items()}
        check_tp(adapters, entries, spec, tp)
    check_target(save_dir, overwrite)
    with atomic_directory(save_dir, overwrite) as work:
        if layout == SWIFT:
            args = swift_args(settings, targets, tp, base_name or str(Path(hf_config_dir).absolute()))
            keys = write_swift_adapter(work, adapters, spec, entries, tp, args)
        else:
            release = work / RELEASE
            release.mkdir()
            keys = write_adapter_checkpoint(release, adapters, spec)
            (release / RUN_CONFIG).write_text(yaml.safe_dump(run_config(settings, targets, tp), sort_keys=False))
            write_tracker(work)
    return AdapterImport(family, settings, targets, keys)
