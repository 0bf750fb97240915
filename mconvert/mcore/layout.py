"""Megatron-Core's checkpoint layout: the key each tensor is stored under (layer and expert stacking, MTP
layers, both specs' names), its global shape and how tensor parallelism splits it, and the `_extra_state`
objects megatron-core asks for. The families in `mconvert.mappings` name Megatron tensors relative to their
scope; this module turns those names into checkpoint keys, global shapes and per-rank chunks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec, MoESpec
from mconvert.mcore.parallelism import Parallelism, padded_vocab_size

Shape = tuple[int, ...]

# Checkpoint keys that hold model weights; others (optimizer state, RNG state, `_extra_state`) are not read.
# `mtp.` holds the multi-token prediction layers.
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
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
# Modules with `_extra_state` that own no tensor we write: attention's core (asked for by megatron-core 0.13/0.14).
EXTRA_STATE_ONLY_MODULES = ("self_attention.core_attention",)


def checkpoint_names(name: str, spec: ModelSpec, is_moe_layer: bool) -> tuple[str, ...]:
    """The names a layer's tensor `name` is written under: its Transformer Engine spec name first, then the
    local spec's where that differs."""
    if is_moe_layer and name == MOE_NORM:
        return (name, MOE_NORM_LOCAL)
    if spec.mla is not None and name in MLA_LOCAL_SPEC_NAMES:
        return (name, MLA_LOCAL_SPEC_NAMES[name])
    return (name,)



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
    # The dtype the tensor has whatever the weights' dtype: Megatron keeps the router's expert bias in fp32
    # (as transformers keeps e_score_correction_bias), since bf16 steps are coarser than its updates.
    dtype: np.dtype | None = None


def tensor_layout(name: str, spec: ModelSpec, par: Parallelism, expert: bool = False) -> TensorLayout:
    """Shape and TP split of the Megatron tensor `name` (relative to its model, layer or expert scope)."""
    H, d = spec.hidden_size, spec.head_dim
    tp = par.expert_tp if expert else par.tp
    moe: MoESpec | None = spec.moe
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return TensorLayout((padded_vocab_size(spec.vocab_size, par), H), 0, par.tp, real_rows=spec.vocab_size)
    if spec.mla is not None and name.startswith("self_attention."):
        return _mla_layout(name, spec, par)
    scope, _, within = name.partition(".")
    if spec.linear_attention is not None and scope == "self_attention" and within.split(".")[0] in GATED_DELTA_NET_MODULES:
        return _gated_delta_net_layout(within, spec, par)
    if spec.mamba is not None and scope == "mixer":
        return _mamba_layout(within, spec, par)
    if name == "eh_proj.weight":
        return TensorLayout((H, 2 * H), 0, par.tp)
    if name == "self_attention.core_attention.softmax_offset":  # attention sinks: one logit per head
        return TensorLayout((spec.num_attention_heads,), 0, par.tp)
    if name == "mlp.router.bias":
        return TensorLayout((moe.num_experts,))
    if name == "mlp.router.expert_bias":
        return TensorLayout((moe.num_experts,), dtype=dtypes.float32)
    if spec.qk_norm_across_heads and name in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        # One weight per channel of the layer's query (key) heads, split across TP ranks as the heads are.
        heads = spec.num_attention_heads if name.startswith("self_attention.q_") else spec.num_query_groups
        return TensorLayout((heads * d,), 0, par.tp)
    if name.endswith("norm.weight") or name.endswith("layer_norm_weight"):
        norm_size = d if name.startswith("self_attention.q_") or name.startswith("self_attention.k_") else H
        return TensorLayout((norm_size,))
    gated = 2 if spec.attention_output_gate else 1  # the output gate's rows beside each query head's
    qkv_rows = spec.num_query_groups * (gated * spec.num_attention_heads // spec.num_query_groups + 2) * d
    if expert:
        ffn = moe.ffn_hidden_size
    elif name.startswith("mlp.shared_experts."):
        ffn = moe.shared_expert_ffn_hidden_size
    else:
        ffn = spec.ffn_hidden_size
    module, param = name.rsplit(".", 1)
    if module.endswith("linear_qkv"):
        return TensorLayout((qkv_rows, H) if param == "weight" else (qkv_rows,), 0, tp)
    if module.endswith("linear_proj"):
        return TensorLayout((H, spec.num_attention_heads * d), 1, tp) if param == "weight" else TensorLayout((H,))
    if module.endswith("linear_fc1"):
        halves = 2 if spec.gated_mlp else 1
        return TensorLayout((halves * ffn, H) if param == "weight" else (halves * ffn,), 0, halves * tp)
    if module.endswith("linear_fc2"):
        return TensorLayout((H, ffn), 1, tp) if param == "weight" else TensorLayout((H,))
    if name == "mlp.router.weight":
        return TensorLayout((moe.num_experts, H))
    if name == "mlp.shared_experts.gate_weight":
        return TensorLayout((1, H))
    raise ConversionError(f"no Megatron layout known for tensor '{name}'")


# Gated delta-net's parameters (megatron-core's GatedDeltaNet, the attention of linear-attention layers). Its
# sharded state dict stores in_proj's and conv1d's sections under keys of their own (`in_proj.weight.query`,
# ...), each split across TP ranks by rows; A_log and dt_bias hold one value per value head.
GATED_DELTA_NET_MODULES = ("in_proj", "conv1d", "A_log", "dt_bias", "out_norm", "out_proj")
_IN_PROJ_SECTIONS = ("query", "key", "value", "z", "beta", "alpha")


def _gated_delta_net_layout(name: str, spec: ModelSpec, par: Parallelism) -> TensorLayout:
    la, H = spec.linear_attention, spec.hidden_size
    rows = {"query": la.key_dim, "key": la.key_dim, "value": la.value_dim, "z": la.value_dim, "beta": la.value_heads, "alpha": la.value_heads}
    module, _, section = name.partition(".weight.")
    if module == "in_proj" and section in _IN_PROJ_SECTIONS:
        return TensorLayout((rows[section], H), 0, par.tp)
    if module == "conv1d" and section in _IN_PROJ_SECTIONS[:3]:
        return TensorLayout((rows[section], 1, la.conv_kernel), 0, par.tp)
    layouts = {
        "in_proj.layer_norm_weight": TensorLayout((H,)),
        "A_log": TensorLayout((la.value_heads,), 0, par.tp),
        "dt_bias": TensorLayout((la.value_heads,), 0, par.tp),
        "out_norm.weight": TensorLayout((la.value_head_dim,)),
        "out_proj.weight": TensorLayout((H, la.value_dim), 1, par.tp),
    }
    if name not in layouts:
        raise ConversionError(f"no Megatron layout known for gated delta-net tensor 'self_attention.{name}'")
    return layouts[name]


def _mamba_layout(name: str, spec: ModelSpec, par: Parallelism) -> TensorLayout:
    """megatron-core's MambaMixer: its sharded state dict stores in_proj's sections (z, x, B, C, dt) and the
    convolution's (x, B, C) under keys of their own, each split across TP ranks by rows, as are A_log, D, dt_bias
    (one per head) and the gated norm; out_proj splits its input."""
    mamba, H = spec.mamba, spec.hidden_size
    module, _, section = name.rpartition(".")
    in_proj, conv = dict(mamba.in_proj_sections()), dict(mamba.conv_sections())
    if module == "in_proj.weight" and section in in_proj:
        return TensorLayout((in_proj[section], H), 0, par.tp)
    if module == "conv1d.weight" and section in conv:
        return TensorLayout((conv[section], 1, 4), 0, par.tp)
    if module == "conv1d.bias" and section in conv:
        return TensorLayout((conv[section],), 0, par.tp)
    layouts = {
        "in_proj.layer_norm_weight": TensorLayout((H,)),
        "A_log": TensorLayout((mamba.num_heads,), 0, par.tp),
        "D": TensorLayout((mamba.num_heads,), 0, par.tp),
        "dt_bias": TensorLayout((mamba.num_heads,), 0, par.tp),
        "norm.weight": TensorLayout((mamba.inner,), 0, par.tp),
        "out_proj.weight": TensorLayout((H, mamba.inner), 1, par.tp),
    }
    if name not in layouts:
        raise ConversionError(f"no Megatron layout known for Mamba tensor 'mixer.{name}'")
    return layouts[name]


def _mla_layout(name: str, spec: ModelSpec, par: Parallelism) -> TensorLayout:
    """Multi-latent attention's tensors, and its sparse-attention indexer's. The down projections are replicated
    across TP ranks (Transformer Engine's duplicated linears); the up projections split whole heads; linear_proj
    splits its input."""
    mla, heads, H = spec.mla, spec.num_attention_heads, spec.hidden_size
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    layouts = {
        "self_attention.linear_q_down_proj.weight": TensorLayout((mla.q_lora_rank, H)),
        "self_attention.linear_q_up_proj.layer_norm_weight": TensorLayout((mla.q_lora_rank,)),
        "self_attention.linear_q_up_proj.weight": TensorLayout((heads * q_head, mla.q_lora_rank), 0, par.tp),
        "self_attention.linear_q_proj.weight": TensorLayout((heads * q_head, H), 0, par.tp),
        "self_attention.linear_kv_down_proj.weight": TensorLayout((mla.kv_lora_rank + mla.qk_pos_emb_head_dim, H)),
        "self_attention.linear_kv_up_proj.layer_norm_weight": TensorLayout((mla.kv_lora_rank,)),
        "self_attention.linear_kv_up_proj.weight": TensorLayout(
            (heads * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank), 0, par.tp
        ),
        "self_attention.linear_proj.weight": TensorLayout((H, heads * mla.v_head_dim), 1, par.tp),
    }
    if (sparse := spec.sparse_attention) is not None:  # the indexer: every tensor whole on every TP rank
        indexer = "self_attention.core_attention.indexer."
        layouts.update({
            indexer + "linear_wq_b.weight": TensorLayout((sparse.index_heads * sparse.index_head_dim, mla.q_lora_rank)),
            indexer + "linear_wk.weight": TensorLayout((sparse.index_head_dim, H)),
            indexer + "k_norm.weight": TensorLayout((sparse.index_head_dim,)),
            indexer + "k_norm.bias": TensorLayout((sparse.index_head_dim,)),
            indexer + "linear_weights_proj.weight": TensorLayout((sparse.index_heads, H)),
        })
    if name not in layouts:
        raise ConversionError(f"no Megatron layout known for multi-latent attention tensor '{name}'")
    return layouts[name]


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

