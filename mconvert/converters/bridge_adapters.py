"""Megatron-Bridge's adapter-only saves, read per Megatron module as the HF projections' own adapters.

Megatron-Bridge's PEFT transforms wrap a Megatron linear with a ParallelLinearAdapter whose `linear_in` is lora_A
([rank, in]) and `linear_out` lora_B ([out, rank]); its output, alpha / dim x B A x, is added to the linear's. Its
adapter-only save (`save_checkpoint` with a `peft` config) is torch_dist holding only the adapters' keys, stacked over
the layers as the base weights are and stored in their global shapes; `run_config.yaml`'s `peft:` section holds the
transform (`_target_`) and its settings. Three transforms are read:

- `LoRA`: one adapter per Megatron linear, `<module>.adapter.linear_in.weight` / `linear_out.weight`. A fused
  linear is several HF modules: lora_B's rows split as the base weight's rows do (the family table's entry for the
  weight, applied to lora_B: q/k/v by query group, fc1 in halves), and lora_A, which reads the input they share, is
  each one's.
- `CanonicalLoRA`: linear_qkv and linear_fc1 carry one adapter per projection (`<module>.adapter.adapter_q.*`, ...,
  `adapter_gate.*`, `adapter_up.*`), each already one HF module's; the other linears are adapted as by LoRA.
- `DoRA`: LoRA's adapters and `<module>.adapter.weight_magnitude` ([out]): its output is m / ||W + s B A|| x
  (W x + s B A x), the norm over each output row, which is PEFT's DoRA with m as `lora_magnitude_vector`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.save_folders import RUN_CONFIG, read_yaml
from mconvert.dependencies import ADAPTERS, ADAPTERS_INSTALL, require
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Concat, QKVInterleave, Rename

ADAPTER = ".adapter."
LORA_A, LORA_B, MAGNITUDE = "linear_in.weight", "linear_out.weight", "weight_magnitude"
LORA_TARGET = "megatron.bridge.peft.lora.LoRA"
# Megatron-Bridge's PEFT transforms by their run_config `_target_`.
KINDS = {
    LORA_TARGET: "lora",
    "megatron.bridge.peft.canonical_lora.CanonicalLoRA": "canonical",
    "megatron.bridge.peft.dora.DoRA": "dora",
}
# CanonicalLoRA's adapters of a fused linear, in the order of the table entry's HF names (q, k, v; gate, up).
CANONICAL = {"linear_qkv": ("adapter_q", "adapter_k", "adapter_v"), "linear_fc1": ("adapter_gate", "adapter_up")}
# Entries whose HF tensors are row ranges of the Megatron weight (or the weight itself): lora_B splits as they do.
ROW_SPLITS = (Rename, Concat, QKVInterleave)


@dataclass(frozen=True)
class LoraSettings:
    """The PEFT transform of a Megatron-Bridge run, from its run_config.yaml `peft:` section (or an ms-swift run's,
    from its args.json)."""

    dim: int
    alpha: float
    dropout: float
    kind: str = "lora"
    rslora: bool = False  # scale alpha / sqrt(dim): ms-swift's use_rslora (Megatron-Bridge has none)
    layout: str = "megatron-bridge"  # whose save: "megatron-bridge" or "ms-swift" (converters.swift_adapters)

    @property
    def scale(self) -> float:
        return self.alpha / (self.dim**0.5 if self.rslora else self.dim)


def read_lora_settings(directory: Path, command: str) -> LoraSettings:
    require(ADAPTERS, command, ADAPTERS_INSTALL)
    path = directory / RUN_CONFIG
    if not path.is_file():
        raise ConversionError(f"{directory}: no {RUN_CONFIG} (Megatron-Bridge writes the LoRA's settings there)")
    peft = read_yaml(path).get("peft")
    if not isinstance(peft, dict):
        raise ConversionError(f"{path}: no peft: section (not an adapter save of a Megatron-Bridge PEFT run)")
    target = peft.get("_target_")
    if target not in KINDS:
        raise ConversionError(f"{path}: peft is {target}; {command} reads {', '.join(KINDS)} adapters only")
    try:
        settings = LoraSettings(int(peft["dim"]), float(peft["alpha"]), float(peft.get("dropout") or 0.0), KINDS[target])
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{path}: peft: section without a usable dim and alpha ({e!r})") from None
    if settings.dim <= 0:
        raise ConversionError(f"{path}: peft: dim is {settings.dim}")
    return settings


@dataclass(frozen=True)
class Part:
    """One HF module's adapter: lora_A [rank, in], lora_B [out, rank] and (DoRA) its magnitudes [out]."""

    hf_name: str
    a: np.ndarray
    b: np.ndarray
    magnitude: np.ndarray | None = None


def check_adapts(a_key: str, a: np.ndarray, b_key: str, b: np.ndarray, entry: Any, spec: ModelSpec, module: str) -> None:
    """That lora_A `a` and lora_B `b` adapt the weight of mapping `entry` in the base model `spec`; else a one-line
    refusal naming both."""
    out, into = entry.split.shape(spec, entry)
    if (b.shape[0], a.shape[1]) != (out, into):
        raise ConversionError(
            f"'{a_key}' {list(a.shape)} and '{b_key}' {list(b.shape)} do not adapt a {[out, into]} weight, "
            f"{module.rsplit('layers.', 1)[-1]}'s of the base model"
        )


def read_layer(dcp: DCPCheckpoint, key: str, offsets: tuple[int, ...], ndim: int = 2) -> np.ndarray:
    if key not in dcp.shapes:
        raise ConversionError(f"{dcp.directory}: '{key}' is missing (the rest of its adapter is there)")
    shape = dcp.shapes[key]
    if len(shape) != len(offsets) + ndim:
        raise ConversionError(f"{dcp.directory}: '{key}' has shape {list(shape)}, not a stack of {ndim}-D tensors")
    region = dcp.read_region(key, (*offsets, *(0,) * ndim), (*(1,) * len(offsets), *shape[len(offsets):]))
    return region.reshape(shape[len(offsets):])


def stored_chunks(dcp: DCPCheckpoint, key: str, offsets: tuple[int, ...]) -> int:
    """How many chunks the layer (expert) at `offsets` of the stacked `key` is stored in. Each TP rank stores its shard
    of a lora_A, split on the rank (column-parallel linears) or the input (row-parallel ones), as a chunk of its own:
    a lora_A's count is the TP size the save was made at."""
    shape = dcp.shapes[key]
    return len(dcp.chunks_of(key, (*offsets, 0, 0), (*(1,) * len(offsets), *shape[len(offsets):])))


def _gated_half_rows(b: np.ndarray, tp: int) -> np.ndarray:
    """CanonicalLoRA's gate (or up) lora_B in the projection's row order. Megatron-Bridge 0.6's
    ParallelLinearAdapter.sharded_state_dict applies fc1's SwiGLU sharding (apply_swiglu_sharded_factory: a TP rank's
    rows are a gate half then an up half) to every adapter of a linear_fc1, the half-size gate and up adapters of
    CanonicalLoRA too: each TP rank's rows of the gate projection are cut in two and its first half stored at
    position rank, the second at tp + rank, of 2 x tp equal row blocks. The stored order is thus a function of the TP
    the save was made at (the identity at TP 1), and is undone here by that TP, which the save records."""
    blocks = b.reshape(2, tp, b.shape[0] // (2 * tp), b.shape[1])
    return blocks.transpose(1, 0, 2, 3).reshape(b.shape)


class AdapterSave:
    """A Megatron-Bridge adapter-only save: the adapters of each Megatron linear, as HF modules' parts. Modules are
    named by their weight's checkpoint key less `.weight` (`decoder.layers.self_attention.linear_qkv`) with the
    leading offsets of the layer (and expert) in the stacked tensors; `left` is the adapter keys not read yet."""

    def __init__(self, dcp: DCPCheckpoint, settings: LoraSettings, spec: ModelSpec):
        self.dcp, self.settings, self.spec = dcp, settings, spec
        self.stored = {key for key in dcp.shapes if ADAPTER in key}
        self.pattern = f"*{ADAPTER}*"  # its keys, for messages
        self.left = set(self.stored)

    def has(self, module: str) -> bool:
        """Whether the save holds any adapter of `module`."""
        return any(key.startswith(module + ADAPTER) for key in self.stored)

    def parts(self, module: str, offsets: tuple[int, ...], entry: Any) -> list[Part]:
        """The HF modules' adapters of the Megatron `module` at `offsets`, whose weight's table entry is `entry`
        (a row split: Rename, Concat or QKVInterleave)."""
        subs = CANONICAL.get(module.rsplit(".", 1)[-1]) if self.settings.kind == "canonical" else None
        if subs is None:
            return self._fused(module, offsets, entry)
        if len(subs) != len(entry.hf_names):  # transformers' fused experts: gate and up in one parameter
            raise ConversionError(
                f"'{module}{ADAPTER}{subs[0]}': CanonicalLoRA's per-projection adapters of one HF tensor "
                f"({entry.hf_names[0]}) are not exported yet"
            )
        out, into = entry.split.shape(self.spec, entry)
        parts = []
        for sub, hf_name, (rows, *_) in zip(subs, entry.hf_names, entry.hf_shapes((out, into), self.spec)):
            name = f"{module}{ADAPTER}{sub}"
            if not any(key.startswith(name + ".") for key in self.stored):  # CanonicalLoRA may target some projections only
                continue
            a, b, tp = self._pair(name, offsets)
            if (b.shape[0], a.shape[1]) != (rows, into):
                raise ConversionError(
                    f"'{name}' lora_A {list(a.shape)} and lora_B {list(b.shape)} do not adapt {hf_name}, "
                    f"a {[rows, into]} weight of the base model"
                )
            if module.endswith("linear_fc1"):
                row_blocks = stored_chunks(self.dcp, f"{name}.{LORA_B}", offsets)
                if row_blocks != 2 * tp:  # the SwiGLU sharding's 2 x TP blocks are what the reordering undoes
                    raise ConversionError(
                        f"'{name}.{LORA_B}': stored in {row_blocks} row blocks at TP {tp}, not the 2 x TP of "
                        "Megatron-Bridge 0.6's gate/up sharding (a layout adapter-to-hf does not know)"
                    )
                b = _gated_half_rows(b, tp)
            parts.append(Part(hf_name, a, b))
        return parts

    def _pair(self, name: str, offsets: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
        a_key, b_key = f"{name}.{LORA_A}", f"{name}.{LORA_B}"
        a, b = (read_layer(self.dcp, key, offsets) for key in (a_key, b_key))
        self.left -= {a_key, b_key}
        dim = self.settings.dim
        if a.shape[0] != dim or b.shape[1] != dim:
            raise ConversionError(f"'{a_key}' {list(a.shape)} and '{b_key}' {list(b.shape)}: not rank {dim}, the dim of {RUN_CONFIG}")
        return a, b, stored_chunks(self.dcp, a_key, offsets)

    def _fused(self, module: str, offsets: tuple[int, ...], entry: Any) -> list[Part]:
        name = module + ADAPTER.rstrip(".")
        a, b, tp = self._pair(name, offsets)
        magnitude = None
        if self.settings.kind == "dora":
            key = f"{name}.{MAGNITUDE}"
            if tp != 1:
                # Its row-parallel linears' magnitudes are each TP rank's shard's row norms (DoRALinear._get_weight_norm
                # norms the rank's own columns), which no DoRA of the whole weight expresses.
                raise ConversionError(f"'{key}': Megatron-Bridge's DoRA saved at TP {tp}; only its TP 1 saves are exported")
            if module.endswith("linear_qkv") and self.spec.qkv_bias:
                raise ConversionError(f"'{key}': Megatron-Bridge's DoRA scales linear_qkv's bias by m / ||W + s B A||, PEFT's does not")
            magnitude = read_layer(self.dcp, key, offsets, ndim=1)
            self.left.discard(key)
            if magnitude.shape != (b.shape[0],):
                raise ConversionError(f"'{key}' {list(magnitude.shape)}: not one magnitude per row of its lora_B {list(b.shape)}")
        check_adapts(f"{name}.{LORA_A}", a, f"{name}.{LORA_B}", b, entry, self.spec, module)
        b_parts = entry.to_hf(b, self.spec)
        m_parts = entry.to_hf(magnitude, self.spec) if magnitude is not None else [None] * len(b_parts)
        return [Part(hf_name, a, b_part, m) for hf_name, b_part, m in zip(entry.hf_names, b_parts, m_parts)]


def merged(weight: np.ndarray, part: Part, scale: float) -> np.ndarray:
    """One HF module's weight with its adapter merged in, in fp32: W + s B A, and with DoRA's magnitudes
    m / ||W + s B A|| x (W + s B A), the norm over each row (the input axis), as Megatron-Bridge's DoRALinear and
    PEFT's DoraLinearLayer both define it."""
    f32 = np.float32
    out = np.asarray(weight, dtype=f32) + f32(scale) * (np.asarray(part.b, dtype=f32) @ np.asarray(part.a, dtype=f32))
    if part.magnitude is not None:
        out *= (np.asarray(part.magnitude, dtype=f32) / np.linalg.norm(out, axis=1))[:, None]
    return out
