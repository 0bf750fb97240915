"""Megatron-Core's checkpoint layout: the key each tensor is stored under (layer and expert stacking, MTP
layers, both specs' names), the vocabulary's padding, and the `_extra_state` objects megatron-core asks for. The
families in `mconvert.mappings` name Megatron tensors relative to their scope and declare each one's shape and
tensor-parallel split (mconvert.mappings.splits); this module turns those into checkpoint keys, global shapes and
per-rank chunks."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.splits import Vocabulary
from mconvert.mappings.transforms import Entry
from mconvert.mcore.parallelism import Parallelism, padded_vocab_size

Shape = tuple[int, ...]

# Checkpoint keys that hold model weights; others (optimizer state, RNG state, `_extra_state`) are not read.
# `mtp.` holds the multi-token prediction layers.
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
# The optimizer's tensors in a torch_dist save: megatron-core's `optimizer.` (its distributed optimizer's
# `optimizer.distributed.`), each optimizer of a ChainedOptimizer under `chained_<i>.`. Every other tensor of a save
# is the model's, read or refused by the export (an unknown module, a layer the model has not); objects (RNG states,
# `_extra_state`) are not tensors.
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
# Megatron-Core's module path of routed experts: the MoE layer's `experts` module holds its own `experts`.
EXPERTS_PREFIX = "mlp.experts.experts."
# The MoE post-attention norm: a module of its own under the Transformer Engine spec; the local spec stores it
# as `mlp.linear_fc1.layer_norm_weight`, as dense layers do under both. Written under both names so the
# checkpoint loads in both specs (checkpoint keys nobody asks for are ignored when loading).
MOE_NORM = "pre_mlp_layernorm.weight"
MOE_NORM_LOCAL = "mlp.linear_fc1.layer_norm_weight"
# How the local (non-TE) spec's module names map to checkpoint names (its `sharded_state_dict_keys_map`): its
# norms are modules of their own, stored under the names of the TE layers they are fused into.
LOCAL_SPEC_RENAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# Multi-latent attention: the latent norms are fused into the up projections under the Transformer Engine spec
# and modules of their own under the local spec, whose MLA layers have no key map at all (so a dense layer's
# post-attention norm is `pre_mlp_layernorm` there). Written under both names, as MOE_NORM.
MLA_LOCAL_SPEC_NAMES = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
# Modules with `_extra_state` that own no tensor we write, by the module of a layer's tensors beside which they
# are: attention's core (asked for by megatron-core 0.13/0.14), in every layer with a self-attention module.
EXTRA_STATE_ONLY_MODULES = {"self_attention.": "self_attention.core_attention"}


def checkpoint_names(name: str, spec: ModelSpec) -> tuple[str, ...]:
    """The names a layer's tensor `name` is written under: its Transformer Engine spec name first, then the
    local spec's where that differs."""
    if name == MOE_NORM:
        return (name, MOE_NORM_LOCAL)
    if spec.mla is not None and name in MLA_LOCAL_SPEC_NAMES:
        return (name, MLA_LOCAL_SPEC_NAMES[name])
    return (name,)


def extra_state_only(names: list[str]) -> list[str]:
    """The modules with an `_extra_state` and no tensor of a layer whose tensors are `names`."""
    return [module for scope, module in EXTRA_STATE_ONLY_MODULES.items() if any(name.startswith(scope) for name in names)]


@dataclass(frozen=True)
class TensorLayout:
    """A Megatron tensor within its scope: its shape and how tensor parallelism splits it.

    Ranks read `fragments` equal parts along `split_axis`. For fused gate/up (fc1) there are 2 x TP of them:
    rank r holds gate part r and up part r + TP, so the stored tensor stays [gate; up] whatever TP is.
    """

    shape: Shape
    split_axis: int | None = None
    fragments: int = 1
    # Rows that hold real data; the rest up to shape[0] is zero padding (the vocabulary).
    real_rows: int | None = None
    # The dtype the tensor has whatever the weights' dtype (its split says: the router's expert bias, fp32).
    dtype: np.dtype | None = None


def tensor_layout(entry: Entry, spec: ModelSpec, par: Parallelism, expert: bool = False) -> TensorLayout:
    """Shape and TP split of the Megatron tensor that the table entry `entry` makes, as its split declares them;
    `expert`: the entry is an expert's, split across the expert tensor-parallel ranks."""
    split = entry.split
    shape = split.shape(spec, entry)
    if isinstance(split, Vocabulary):
        return TensorLayout((padded_vocab_size(shape[0], par), *shape[1:]), 0, par.tp, real_rows=shape[0])
    if split.axis is None:
        return TensorLayout(shape, dtype=split.dtype)
    tp = par.expert_tp if expert else par.tp
    return TensorLayout(shape, split.axis, split.halves * tp, dtype=split.dtype)


def mtp_key(name: str, mtp_layer: int) -> str:
    """A multi-token prediction layer's key (megatron-core 0.16.1's MultiTokenPredictionBlock: never stacked)."""
    return f"mtp.layers.{mtp_layer}.{name}"


def layer_key(name: str, layer: int, spec: ModelSpec) -> tuple[str, tuple[int, ...]]:
    """Checkpoint key and leading offsets of a layer's tensor: stacked along a layer axis when all layers are
    alike, else one key per layer. Layers from num_layers on are the decoder layers of the multi-token
    prediction layers."""
    if layer >= spec.num_layers:
        return mtp_key(f"transformer_layer.{name}", layer - spec.num_layers), ()
    if spec.uniform_layers:
        return f"decoder.layers.{name}", (layer,)
    return f"decoder.layers.{layer}.{name}", ()


def layer_axis(spec: ModelSpec) -> Shape:
    return (spec.num_layers,) if spec.uniform_layers else ()


def extra_state_key(module_key: str, offsets: tuple[int, ...], leading_shape: Shape) -> str:
    """The ShardedObject key megatron-core asks for a module's `_extra_state` (see make_sharded_object_for_checkpoint)."""
    if not offsets:
        offsets, leading_shape = (0,), (1,)
    return f"{module_key}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, leading_shape))}"

