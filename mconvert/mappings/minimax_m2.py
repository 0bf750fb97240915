"""MiniMax-M2 (`minimax_m2`, transformers' own MiniMaxM2ForCausalLM): grouped-query attention whose q and k are
each RMS-normalised over all heads of the layer together (`q_norm` [heads x head_dim]), rope on the first
`rotary_dim` dims of each head, and Mixtral's experts in every layer (`block_sparse_moe`, w1/w3/w2) routed by
sigmoid scores with a routing bias that only chooses experts, the top-k weights renormalised.

megatron-core's q/k norms span one head; the norms across heads are mconvert's module in the layer spec
(mconvert.megatron_lm.layer_specs, which Megatron-LM loads by `--spec`). Their weights are stored whole under
megatron-core's q/k norm names, split across tensor-parallel ranks as the heads are. Like transformers, the model
always has the norms and the routing bias, whatever `use_qk_norm`, `qk_norm_type`, `use_routing_bias` and
`scoring_func` say, and attends fully on every layer (`attn_type_list`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek, llama, mixtral, qwen2_moe
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, MoESpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import Column, attention_width
from mconvert.mappings.transforms import Rename


def _key_width(spec: ModelSpec) -> int:
    """Every key head's channels."""
    return spec.num_query_groups * spec.head_dim


# The q/k norms across heads: one weight per channel of the layer's query (key) heads, split across TP ranks as
# the heads are; in place of Llama's, which span one head.
QK_NORMS = {
    entry.mcore: entry
    for entry in (
        Rename("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when="qk_norm", split=Column(attention_width)),
        Rename("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when="qk_norm", split=Column(_key_width)),
    )
}
ATTENTION = tuple(QK_NORMS.get(entry.mcore, entry) for entry in llama.ATTENTION)

ROUTING_BIAS = Rename("mlp.router.expert_bias", "block_sparse_moe.e_score_correction_bias", split=deepseek.EXPERT_BIAS)

# MiniMax's published checkpoints (M2 to M2.7) hold no weights for the modules their configs name
# (`num_mtp_modules: 3`; MiniMax-AI/MiniMax-M2.7 issue 16 counts 0 `mtp.*` keys of 1,369), and transformers' model has
# none to load any into: nothing defines their names or checks a conversion of them.
MTP_LEFT_OUT = ("MiniMax publishes no weights for them, and transformers' MiniMax-M2 has no multi-token prediction "
                "modules to check a conversion of them against")

TABLE = Table(
    model=llama.MODEL,
    attention=ATTENTION,
    dense_mlp=(),
    moe_mlp=(*mixtral.ROUTER, ROUTING_BIAS),
    experts=mixtral.EXPERTS,
    # transformers v5 in memory: Mixtral's fused layout, the routing bias beside the router under `mlp.`.
    fused_experts=qwen2_moe.FUSED_EXPERTS,
    fused_moe_mlp=(*qwen2_moe.ROUTER, Rename("mlp.router.expert_bias", "mlp.e_score_correction_bias", split=deepseek.EXPERT_BIAS)),
    mtp_left_out=MTP_LEFT_OUT,
    mtp_count_field="num_mtp_modules",
)


def rotary_percent(config: dict[str, Any], head_dim: int, source: str) -> float:
    """The released configs' `rotary_dim`; transformers v5 writes `partial_rotary_factor` into rope_parameters."""
    rotary_dim = config.get("rotary_dim")
    if rotary_dim is None:
        return float((config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConversionError(f"{source}: rotary_dim {rotary_dim!r} is not an even number of dims within head_dim {head_dim}")
    return rotary_dim / head_dim


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    spec = read_dense_spec(config, "minimax_m2", source, qk_norm=True, qk_norm_across_heads=True)
    top_k = require(config, "num_experts_per_tok", source)
    if top_k == 1:
        raise ConversionError(f"{source}: num_experts_per_tok 1: megatron-core renormalises sigmoid top-k weights only when k > 1")
    moe = MoESpec(
        num_experts=require(config, "num_local_experts", source),
        top_k=top_k,
        ffn_hidden_size=spec.ffn_hidden_size,
        moe_layers=(True,) * spec.num_layers,
        router_pre_softmax=False,
        score_function="sigmoid",
        expert_bias=True,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        router_fp32=True,
    )
    return dataclasses.replace(spec, moe=moe, rotary_percent=rotary_percent(config, spec.head_dim, source))


def write_config(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    if (
        moe is None or not all(moe.moe_layers) or moe.score_function != "sigmoid" or not moe.expert_bias
        or moe.shared_expert_ffn_hidden_size or moe.ffn_hidden_size != spec.ffn_hidden_size or moe.num_groups
        or moe.topk_scaling_factor is not None or spec.linear_bias or spec.qkv_bias or not spec.qk_norm_across_heads
    ):
        raise ConversionError(
            "minimax_m2 has experts of intermediate_size in every layer, routed by sigmoid scores with a routing "
            f"bias, no shared expert, no biases and q/k norms across heads: this model differs ({moe})"
        )
    config = write_dense_config(spec, "minimax_m2", "MiniMaxM2ForCausalLM")
    config.update(
        # Both: MiniMax's own code and transformers 5.24 read rotary_dim; transformers 5.17 reads only the factor.
        partial_rotary_factor=spec.rotary_percent,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coeff,
        rotary_dim=round(spec.rotary_percent * spec.head_dim),
        use_qk_norm=True,
        qk_norm_type="per_layer",
        scoring_func="sigmoid",
        use_routing_bias=True,
    )
    return config


FAMILY = Family(
    name="minimax_m2",
    model_types=("minimax_m2",),
    model_sizes=("minimax-m2",),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("MiniMaxM2ForCausalLM", "minimax_m2"),),
)
