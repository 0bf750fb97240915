"""ms-swift's saves of the Qwen3-Next and Qwen3.5 families (mcore-bridge 1.6.5's GatedDeltaNet and GatedSelfAttention,
its default `USE_MCORE_GDN`), read as megatron-core's: recognised by ms-swift's `args.json` beside the save and, for
these families, by the fused delta-net keys (a save without them, in megatron-core's own keys, is read as it is).
What differs from megatron-core's layout, read from mcore-bridge's code (`modules/gated_delta_net.py`,
`gpts/qwen3_next_gdn.py`, `mm_gpts/qwen3_5_gdn.py`, `bridge/gpt_bridge.py`'s `_set_linear_in_proj`,
`_set_linear_attn_state` and `_set_qkv`):

- a delta-net layer's input projection is one column-parallel tensor `self_attention.in_proj.weight`, its rows per key
  head [q; k; v; z; b; a] (Qwen3-Next's in_proj_qkvz and in_proj_ba rows of that head, one after the other;
  Qwen3.5's from its in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, `GPTBridge._set_linear_in_proj`), where
  megatron-core keys each section (`in_proj.weight.query`, ...) with every head's rows in order;
- its convolution is one tensor `self_attention.conv1d.weight`, channels per key head [q; k; v], where megatron-core
  keys each section;
- its output norm `self_attention.out_norm.weight` is stored as HF's w (mcore-bridge turns zero-centring off for
  it, `Qwen3NextLoader.build_model`), where megatron-core's is zero-centred (w - 1);
- a full-attention layer's gated `linear_qkv` holds, per query group, each head's query and gate rows side by side
  (HF's q_proj rows as they are), then the key and value, where megatron-core groups the queries, then the gates; the
  multi-token prediction layer's too (its layer spec is the decoder's last, full attention: `register.py`'s
  `get_mtp_block_spec`).

Qwen3.5's image-text model is mcore-bridge's MultimodalGPTModel (`model/mm_gpt_model.py`): the language model (the
layout above) under `language_model.`, and the vision tower transformers' own module (`mm_gpts/qwen3_5.py`'s
Qwen3_5Vit, whose `visual` is transformers' Qwen3_5VisionModel) under `visual.`, so that megatron-core's default
sharded state dict keys its tensors `visual.visual.<HF name within model.visual.>`, whole and replicated
(`SwiftLanguageModel`); a `language_model_only` run saves no vision tower.

Each rank holds whole key heads (query groups) of these column-parallel tensors in that per-head order, and torch_dist
stores their concatenation over the TP ranks in rank order: every head in order, whatever the TP size the run saved
at. Every other tensor is megatron-core's. The sections are read out of the fused tensors (the norm in float32, so
that adding 1 back gives w exactly)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mconvert.converters.bridge_saves import LanguageModelTensors, SavedTensor, region_reader
from mconvert.converters.plan import Piece, Plan
from mconvert.converters.wrapped_save import WrappedSave
from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec

Shape = tuple[int, ...]
# The families whose ms-swift layout this module reads: mcore-bridge registers its Qwen3-Next bridge for
# `qwen3_next`, its Qwen3.5 one (the same layer layout) for `qwen3_5` and `qwen3_5_moe`, both mconvert's qwen3_5.
FAMILIES = ("qwen3_next", "qwen3_5")
IN_PROJ, CONV1D = "self_attention.in_proj.weight", "self_attention.conv1d.weight"
OUT_NORM, LINEAR_QKV = "self_attention.out_norm.weight", "self_attention.linear_qkv.weight"
# Qwen3_5Vit.module_mapping: HF's prefix -> the module's within the vision model (`visual.`).
VISION_MODULES = {"model.visual.": "visual."}
SECTION_KEY = re.compile(rf"^(.*)({re.escape(IN_PROJ)}|{re.escape(CONV1D)})\.(\w+)$")


def per_head_sections(spec: ModelSpec, fused: str) -> dict[str, tuple[int, int]]:
    """(first row, rows) of each section within one key head's rows of a fused delta-net tensor."""
    la = spec.linear_attention
    per_key = la.value_heads // la.key_heads
    sizes = [("query", la.key_head_dim), ("key", la.key_head_dim), ("value", per_key * la.value_head_dim)]
    if fused == IN_PROJ:
        sizes += [("z", per_key * la.value_head_dim), ("beta", per_key), ("alpha", per_key)]
    starts = np.cumsum([0] + [rows for _, rows in sizes])
    return {name: (int(start), rows) for (name, rows), start in zip(sizes, starts)}


def gated_qkv_as_megatron_cores(stored: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """mcore-bridge's per-group [(query, gate) of each head; k; v] rows as megatron-core's [queries; gates; k; v]."""
    groups, per_group, d = spec.num_query_groups, spec.num_attention_heads // spec.num_query_groups, spec.head_dim
    rest = stored.shape[1:]
    grouped = stored.reshape(groups, -1, *rest)
    heads = grouped[:, : 2 * per_group * d].reshape(groups, per_group, 2, d, *rest)
    queries_then_gates = heads.swapaxes(1, 2).reshape(groups, 2 * per_group * d, *rest)
    return np.concatenate([queries_then_gates, grouped[:, 2 * per_group * d :]], axis=1).reshape(stored.shape)


@dataclass
class SwiftTensors(WrappedSave):
    """An ms-swift torch_dist save (`inner`, a TorchDistTensors, or a SwiftLanguageModel of an image-text save) with its
    Qwen3-Next or Qwen3.5 delta-net and gated-attention tensors presented in megatron-core's layout; other families'
    tensors pass through as stored."""

    spec: ModelSpec | None = field(default=None, init=False)  # the model read, known once the plan is (stored_shapes)
    # Whether the save holds the fused delta-net keys (a Qwen3-Next family's save in mcore-bridge's layout), told
    # by stored_shapes; without them (megatron-core's own keys) every tensor passes through as stored.
    fused: bool = field(default=False, init=False)

    def stored_shapes(self, plan: Plan) -> dict[str, Shape]:
        shapes = self.inner.stored_shapes(plan)
        self.spec = plan.spec
        self.fused = plan.spec.family in FAMILIES and any(key.endswith((IN_PROJ, CONV1D)) for key in shapes)
        if not self.fused:
            return shapes
        presented = {}
        for key, shape in shapes.items():
            fused = next((name for name in (IN_PROJ, CONV1D) if key.endswith(name)), None)
            sections = {name: plan.shapes.get(f"{key}.{name}") for name in per_head_sections(plan.spec, fused)} if fused else {}
            if not sections or None in sections.values():
                presented[key] = shape  # not fused, or not a tensor of the model (check_stored names it)
                continue
            axis = len(shape) - (2 if fused == IN_PROJ else 3)  # past the layer axis of a stacked tensor
            rows = sum(section[axis] for section in sections.values())
            if rows != shape[axis]:
                raise ConversionError(
                    f"{self.location}: tensor '{key}' has {shape[axis]} rows where the model's {', '.join(sections)} "
                    f"sections have {rows} (ms-swift's fused delta-net layout)"
                )
            presented.update({f"{key}.{name}": section for name, section in sections.items()})
        return presented

    def read_piece(self, piece: Piece, into: np.ndarray | None = None) -> np.ndarray:
        key = piece.key
        if not self.fused:
            return self.inner.read_piece(piece, into)
        spec = self.spec
        if match := SECTION_KEY.match(key):
            prefix, fused, name = match.groups()
            stored = self.read_whole(prefix + fused, piece.offsets)
            first, rows = per_head_sections(spec, fused)[name]
            heads = stored.reshape(spec.linear_attention.key_heads, -1, *stored.shape[1:])
            return np.ascontiguousarray(heads[:, first : first + rows]).reshape(-1, *stored.shape[1:])
        if key.endswith(OUT_NORM):
            return self.read_whole(key, piece.offsets).astype(np.float32) - np.float32(1.0)
        if key.endswith(LINEAR_QKV) and spec.attention_output_gate:
            return gated_qkv_as_megatron_cores(self.read_whole(key, piece.offsets), spec)
        return self.inner.read_piece(piece, into)

    def byte_span(self, key: str, offsets: Shape, shape: Shape, dtype: np.dtype) -> tuple[Path, int] | None:
        if self.fused and (SECTION_KEY.match(key) or key.endswith((OUT_NORM, LINEAR_QKV))):
            return None
        return super().byte_span(key, offsets, shape, dtype)


@dataclass
class SwiftLanguageModel(LanguageModelTensors):
    """ms-swift's image-text save: the language model under `language_model.`, and transformers' vision tower under
    `visual.` in its own names (`VISION_MODULES`), each tensor whole, in the export's dtype."""

    vision = "visual."

    def vision_tower(self, plan: Plan) -> dict[str, SavedTensor]:
        found: dict[str, SavedTensor] = {}
        for key, shape in self.vision_shapes(plan).items():
            hf = next((prefix + key.removeprefix(module) for prefix, module in VISION_MODULES.items() if key.startswith(module)), None)
            if hf is None:
                raise ConversionError(f"{self.location}: vision tensor '{self.vision}{key}' is not under ms-swift's Qwen3.5 vision tower ({', '.join(self.vision + module for module in VISION_MODULES.values())})")
            whole = tuple(shape)
            found[hf] = SavedTensor(plan.dtype, whole, region_reader(self.inner.dcp, self.vision + key, (0,) * len(whole), whole, whole, 0, plan.dtype))
        return found
