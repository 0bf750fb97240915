"""Megatron-Bridge's vision-language saves (Qwen3.5 and Qwen3-VL, its Qwen3VLModel): the language model,
megatron-core's GPTModel keys, under `language_model.`, and the vision tower beside it under `vision_model.`, a
megatron-core transformer block of its own with Megatron-Bridge's patch embedding, position embedding and merger
(and Qwen3-VL's deepstack mergers, under the block: `decoder.deepstack_merger_list.`). Recognised by the keys
(`open_megatron_checkpoint` wraps a save holding `language_model.` keys); the language model is read through the
family's plan as any GPTModel save, the vision tower is written under the HF image-text names by the table below,
read from Megatron-Bridge 0.6.2's Qwen3.5 and Qwen3-VL bridges (`qwen35_vl_bridge._get_vision_mappings`,
`qwen3_vl_bridge.Qwen3VLBridge.mapping_registry`): renames, and each block's fused QKV de-interleaved (its
ConcatenatedQKVMapping: per head [q; k; v] rows, every head its own query group, where HF holds [q; k; v] of all
heads). torch_dist stores global tensors, so the TP size of the save does not matter; a block's (or deepstack
merger's) tensors are stacked (`decoder.layers.<name>`, leading axis the block) or keyed one by one
(`decoder.layers.<i>.<name>`, Megatron-Bridge's heterogeneous checkpoints), both read."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.plan import Piece, Plan
from mconvert.converters.wrapped_save import WrappedSave, wrapped
from mconvert.dtypes import cast
from mconvert.errors import ConversionError

Shape = tuple[int, ...]
LANGUAGE_MODEL = "language_model."
VISION_MODEL = "vision_model."

# Megatron-Bridge's vision-tower names (under `vision_model.`) -> HF's (under the family's vision prefix).
BLOCK_NAMES = {
    "self_attention.linear_proj.weight": "attn.proj.weight",
    "self_attention.linear_proj.bias": "attn.proj.bias",
    "self_attention.linear_qkv.weight": "attn.qkv.weight",
    "self_attention.linear_qkv.bias": "attn.qkv.bias",
    "self_attention.linear_qkv.layer_norm_weight": "norm1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "norm1.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc1.layer_norm_weight": "norm2.weight",
    "mlp.linear_fc1.layer_norm_bias": "norm2.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}
# A patch merger's names, Qwen3-VL's deepstack mergers' as the final one's (`merger.`).
MERGER_NAMES = {
    "patch_norm.weight": "norm.weight",
    "patch_norm.bias": "norm.bias",
    "linear_fc1.weight": "linear_fc1.weight",
    "linear_fc1.bias": "linear_fc1.bias",
    "linear_fc2.weight": "linear_fc2.weight",
    "linear_fc2.bias": "linear_fc2.bias",
}
TOWER_NAMES = {
    "patch_embed.proj.weight": "patch_embed.proj.weight",
    "patch_embed.proj.bias": "patch_embed.proj.bias",
    "pos_embed.weight": "pos_embed.weight",
    **{"merger." + megatron: "merger." + hf for megatron, hf in MERGER_NAMES.items()},
}
BLOCKS = "decoder.layers."
# The tower's numbered modules, each stacked under one key a name (the leading axis its number, as the blocks and
# Qwen3-VL's deepstack mergers are; Qwen3VLVisionTransformerBlock.sharded_state_dict) or keyed one by one
# (`<prefix><number>.<name>`): Megatron-Bridge's prefix -> (HF's prefix, the names).
STACKED = {
    BLOCKS: ("blocks.", BLOCK_NAMES),
    "decoder.deepstack_merger_list.": ("deepstack_merger_list.", MERGER_NAMES),
}
FUSED_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")


@dataclass
class LanguageModelTensors(WrappedSave):
    """A save's language model under `language_model.` (a MegatronTensors of the save's GPTModel keys), and the
    save's vision tower under `vision`, read apart (`vision_tower`): Megatron-Bridge's, here."""

    vision = VISION_MODEL  # the prefix of the save's vision tower

    @property
    def weights_dtype(self) -> Any:
        return self.inner.dcp.dtypes.get(LANGUAGE_MODEL + "embedding.word_embeddings.weight")

    def all_shapes(self, plan: Plan) -> dict[str, Shape]:
        return self.inner.stored_shapes(plan)

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        shapes = self.all_shapes(plan)
        other = sorted(key for key in shapes if not key.startswith((LANGUAGE_MODEL, self.vision)))
        if other:
            raise ConversionError(f"{self.location}: tensor '{other[0]}' is neither the language model's ({LANGUAGE_MODEL}) nor the vision tower's ({self.vision})")
        return {key.removeprefix(LANGUAGE_MODEL): shape for key, shape in shapes.items() if key.startswith(LANGUAGE_MODEL)}

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> np.ndarray:
        return self.inner.read_piece(dataclasses.replace(piece, keys=tuple(LANGUAGE_MODEL + key for key in piece.keys)), into)

    def read_whole(self, key: str, offsets: Shape) -> np.ndarray:
        return self.inner.read_whole(LANGUAGE_MODEL + key, offsets)

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: np.dtype) -> tuple[Path, int] | None:
        return self.inner.byte_span(LANGUAGE_MODEL + key, offsets, shape, dtype)

    def vision_shapes(self, plan: Plan) -> dict[str, Shape]:
        """The stored vision tensors' shapes, by key within the vision tower."""
        return {key.removeprefix(self.vision): shape for key, shape in self.all_shapes(plan).items() if key.startswith(self.vision)}

    def vision_tower(self, plan: Plan) -> dict[str, SavedTensor]:
        """The HF tensors of the vision tower the save holds, every stored vision tensor taken by a name of the
        table, in the export's dtype."""
        shapes = self.vision_shapes(plan)
        if not shapes:
            return {}
        prefixes = plan.family.table.copied_back
        vision = (plan.spec.hf_config or {}).get("vision_config") or {}
        if not prefixes or "num_heads" not in vision:
            raise ConversionError(f"{self.location}: holds a vision tower ({VISION_MODEL}), which the {plan.family.name} export has no place for")
        prefix, heads, dcp, dtype = prefixes[0], int(vision["num_heads"]), self.inner.dcp, plan.dtype
        found: dict[str, SavedTensor] = {}
        for key, shape in shapes.items():
            if key in TOWER_NAMES:
                whole = tuple(shape)
                found[prefix + TOWER_NAMES[key]] = SavedTensor(dtype, whole, region_reader(dcp, VISION_MODEL + key, (0,) * len(whole), whole, whole, 0, dtype))
                continue
            stacked = next((stacked for stacked in STACKED if key.startswith(stacked)), None)
            hf_prefix, names = STACKED.get(stacked, ("", {}))
            one = re.fullmatch(rf"{re.escape(stacked or '')}(\d+)\.(.+)", key)
            name = one.group(2) if one else key.removeprefix(stacked or "")
            if stacked is None or name not in names:
                raise ConversionError(f"{self.location}: vision tensor '{VISION_MODEL}{key}' is not one Megatron-Bridge's Qwen vision tower holds")
            numbers = [int(one.group(1))] if one else range(shape[0])
            inner = tuple(shape) if one else tuple(shape[1:])
            qkv_heads = heads if stacked == BLOCKS and name in FUSED_QKV else 0
            for number in numbers:
                offsets = (0,) * len(inner) if one else (number, *(0,) * len(inner))
                region = inner if one else (1, *inner)
                found[f"{prefix}{hf_prefix}{number}.{names[name]}"] = SavedTensor(dtype, inner, region_reader(dcp, VISION_MODEL + key, offsets, region, inner, qkv_heads, dtype))
        return found


@dataclass(frozen=True)
class SavedTensor:
    """An HF tensor the export builds from the save outside the plan (the vision tower): its dtype, shape, and how
    it is read."""

    dtype: np.dtype
    shape: Shape
    read: Callable[[], np.ndarray]


def regroup_qkv(fused: np.ndarray, heads: int, to_megatron: bool) -> np.ndarray:
    """A vision block's fused QKV rows between HF's [q; k; v] of all heads and Megatron's per head [q; k; v] (each
    head its own query group): the rows' two outer axes (3 and the heads) swapped, either way."""
    outer = (3, heads) if to_megatron else (heads, 3)
    return np.ascontiguousarray(fused.reshape(*outer, -1, *fused.shape[1:]).swapaxes(0, 1)).reshape(fused.shape)


def deinterleave_qkv(fused: np.ndarray, heads: int) -> np.ndarray:
    """Megatron's per-head [q; k; v] rows as HF's [q; k; v] of all heads."""
    return regroup_qkv(fused, heads, to_megatron=False)


def interleave_qkv(fused: np.ndarray, heads: int) -> np.ndarray:
    """HF's [q; k; v] rows of all heads as Megatron's per head [q; k; v]."""
    return regroup_qkv(fused, heads, to_megatron=True)


def stacked_prefix(key: str) -> str | None:
    """The prefix (under `vision_model.`) of the numbered modules whose stacked key `key` is; None for the rest."""
    return next((VISION_MODEL + prefix for prefix in STACKED if key.startswith(VISION_MODEL + prefix)), None)


def vision_keys(hf_names: Iterable[str], prefix: str) -> dict[str, tuple[str, ...]]:
    """Each key of the vision tower as Megatron-Bridge's Qwen3VLModel saves it (under `vision_model.`; its numbered
    modules stacked, `decoder.layers.<name>` with the block as leading axis: its vision config leaves
    `hetereogenous_dist_checkpoint` off) and the HF tensors (under `prefix`) it is made of, in their order. From the
    same table the export reads the save by; an HF vision tensor the table has no name for is an error."""
    tower = {hf: mb for mb, hf in TOWER_NAMES.items()}
    numbered = [(re.compile(rf"{re.escape(hf_prefix)}(\d+)\.(.+)"), stacked, {hf: mb for mb, hf in names.items()})
                for stacked, (hf_prefix, names) in STACKED.items()]
    keys: dict[str, list[tuple[int, str]]] = {}
    for name in hf_names:
        local = name.removeprefix(prefix)
        if local in tower:
            keys[VISION_MODEL + tower[local]] = [(0, name)]
            continue
        found = next(((match, stacked, names) for pattern, stacked, names in numbered
                      if (match := pattern.fullmatch(local)) and match.group(2) in names), None)
        if found is None:
            raise ConversionError(f"tensor '{name}': a vision tensor Megatron-Bridge's Qwen vision tower has no place for")
        match, stacked, names = found
        keys.setdefault(VISION_MODEL + stacked + names[match.group(2)], []).append((int(match.group(1)), name))
    for key, held in keys.items():
        if stacked_prefix(key) and sorted(number for number, _ in held) != list(range(len(held))):
            raise ConversionError(f"tensor '{key}': the HF vision modules holding it are not numbered 0 to {len(held) - 1}")
    return {key: tuple(name for _, name in sorted(held)) for key, held in keys.items()}


def vision_tower(source: Any, plan: Plan) -> dict[str, SavedTensor]:
    """The HF tensors of the vision tower a vision-language save holds (`source` a LanguageModelTensors, or a reader
    wrapping one), none for any other save."""
    save = wrapped(source, LanguageModelTensors)
    return save.vision_tower(plan) if save is not None else {}


def region_reader(dcp: Any, key: str, offsets: Shape, region: Shape, shape: Shape, qkv_heads: int, dtype: np.dtype) -> Callable[[], np.ndarray]:
    """How one stored region (a block's slice of a stacked tensor, or a whole tensor) is read as its HF tensor."""

    def read() -> np.ndarray:
        tensor = dcp.read_region(key, offsets, region).reshape(shape)
        return cast(deinterleave_qkv(tensor, qkv_heads) if qkv_heads else tensor, dtype)

    return read
