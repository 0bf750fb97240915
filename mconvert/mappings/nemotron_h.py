"""Nemotron-H (`nemotron_h`: Nemotron-H, Nemotron Nano v2, Nemotron 3 Nano and Super): each HF layer is one block with
its own pre-norm, as `hybrid_override_pattern` names it in megatron-core's symbols: a Mamba-2 mixer (`M`), attention
without position embeddings (`*`), an MLP without a gate, relu(x)^2 (`-`), or experts routed by sigmoid scores with
an expert bias and one shared expert (`E`), in Super working in a narrower latent width. Only megatron-core's
HybridModel holds it: HF layer i is hybrid layer i; Super's MTP layer is a small stack of such blocks.

The Mamba mixer fuses z, x, B, C and dt into `in_proj` and convolves x, B and C as one; megatron-core stores each
section under a key of its own (`in_proj.weight.z`, `conv1d.weight.x`, ...), each split across TP ranks by rows:
each is one Section of the HF tensor. The layer's norm is fused into in_proj under the Transformer Engine spec."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek
from mconvert.mappings.family import Family, Table
from mconvert.mappings.mamba_spec import MambaSpec
from mconvert.mappings.spec import ModelSpec, read_dense_spec, require, write_dense_config
from mconvert.mappings.splits import Column, Replicated, Row, Sectioned, Vocabulary, attention_width, expert_width
from mconvert.mappings.transforms import QKVInterleave, Rename, Section

MODEL = (
    Rename("embedding.word_embeddings.weight", "backbone.embeddings.weight", split=Vocabulary()),
    Rename("decoder.final_layernorm.weight", "backbone.norm_f.weight", split=Replicated("hidden_size")),
    Rename("output_layer.weight", "lm_head.weight", when="untie_embeddings", split=Vocabulary()),
)


def _in_proj(spec: ModelSpec):
    return 1, spec.mamba.in_proj_sections()


def _conv(spec: ModelSpec):
    return 1, spec.mamba.conv_sections()


# megatron-core's MambaMixer splits its heads across TP ranks: the sections of in_proj and conv1d by rows (conv1d's 4
# taps, fixed), A_log, D and dt_bias (one per head) and the gated norm; out_proj by its input.
MAMBA = (
    Rename("mixer.in_proj.layer_norm_weight", "norm.weight", split=Replicated("hidden_size")),
    *(Section(f"mixer.in_proj.weight.{name}", "mixer.in_proj.weight", sections=_in_proj, section=name, split=Sectioned("hidden_size"))
      for name in ("z", "x", "B", "C", "dt")),
    *(Section(f"mixer.conv1d.{param}.{name}", f"mixer.conv1d.{param}", sections=_conv, section=name, split=split)
      for param, split in (("weight", Sectioned(1, 4)), ("bias", Sectioned())) for name in ("x", "B", "C")),
    Rename("mixer.A_log", "mixer.A_log", split=Column("mamba.num_heads")),
    Rename("mixer.D", "mixer.D", split=Column("mamba.num_heads")),
    Rename("mixer.dt_bias", "mixer.dt_bias", split=Column("mamba.num_heads")),
    Rename("mixer.norm.weight", "mixer.norm.weight", split=Column("mamba.inner")),
    Rename("mixer.out_proj.weight", "mixer.out_proj.weight", split=Row("hidden_size", "mamba.inner")),
)

ATTENTION = (
    Rename("self_attention.linear_qkv.layer_norm_weight", "norm.weight", split=Replicated("hidden_size")),
    QKVInterleave(
        "self_attention.linear_qkv.weight", "mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight",
        split=Column(QKVInterleave.fused_rows, "hidden_size"),
    ),
    Rename("self_attention.linear_proj.weight", "mixer.o_proj.weight", split=Row("hidden_size", attention_width)),
)

# The MLPs have no gate: fc1 is the up projection alone, split by rows as a column-parallel layer's.
DENSE_MLP = (
    Rename("mlp.linear_fc1.layer_norm_weight", "norm.weight", split=Replicated("hidden_size")),
    Rename("mlp.linear_fc1.weight", "mixer.up_proj.weight", split=Column("ffn_hidden_size", "hidden_size")),
    Rename("mlp.linear_fc2.weight", "mixer.down_proj.weight", split=Row("hidden_size", "ffn_hidden_size")),
)

MOE_MLP = (
    Rename("pre_mlp_layernorm.weight", "norm.weight", split=Replicated("hidden_size")),
    Rename("mlp.router.weight", "mixer.gate.weight", split=Replicated("moe.num_experts", "hidden_size")),
    Rename("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias", split=deepseek.EXPERT_BIAS),
    Rename(
        "mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight",
        split=Column("moe.shared_expert_ffn_hidden_size", "hidden_size"),
    ),
    Rename(
        "mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight",
        split=Row("hidden_size", "moe.shared_expert_ffn_hidden_size"),
    ),
    # Latent MoE (Nemotron 3 Super): the routed experts work in a narrower width, projected into it after routing and
    # back before the shared expert's output is added. megatron-core's projections are Transformer Engine linears in
    # its "duplicated" mode: whole on every TP rank.
    Rename("mlp.fc1_latent_proj.weight", "mixer.fc1_latent_proj.weight", when="moe_latent",
           split=Replicated("moe.latent_size", "hidden_size")),
    Rename("mlp.fc2_latent_proj.weight", "mixer.fc2_latent_proj.weight", when="moe_latent",
           split=Replicated("hidden_size", "moe.latent_size")),
)

EXPERTS = (
    Rename("linear_fc1.weight", "mixer.experts.{expert}.up_proj.weight", split=Column("moe.ffn_hidden_size", expert_width)),
    Rename("linear_fc2.weight", "mixer.experts.{expert}.down_proj.weight", split=Row(expert_width, "moe.ffn_hidden_size")),
)

# An MTP layer (Nemotron 3 Super's) is a small stack of blocks, `mtp_hybrid_override_pattern`, each an HF layer
# `mtp.layers.<i>.` after the decoder's (layer i of MTP layer m: block i - m x the pattern's length): its first block
# holds the embedding's and the hidden state's norms and their projection, its last the final norm (the names vLLM's
# NemotronHMTP loads; transformers builds no MTP layers). megatron-core's HybridModel keeps these in
# `mtp.layers.<m>.` and the blocks in `mtp.layers.<m>.mtp_model_layer.layers.<j>.`.
MTP = (
    Rename("enorm.weight", "enorm.weight", split=Replicated("hidden_size")),
    Rename("hnorm.weight", "hnorm.weight", split=Replicated("hidden_size")),
    Rename("eh_proj.weight", "eh_proj.weight", split=Column("hidden_size", deepseek.twice_hidden)),
)
MTP_END = (Rename("final_layernorm.weight", "final_layernorm.weight", split=Replicated("hidden_size")),)

TABLE = Table(
    model=MODEL,
    attention=ATTENTION,
    dense_mlp=DENSE_MLP,
    moe_mlp=MOE_MLP,
    experts=EXPERTS,
    mamba=MAMBA,
    layer_prefix="backbone.layers.{layer}.",
    mtp=MTP,
    mtp_end=MTP_END,
    mtp_layer_prefix="mtp.layers.{layer}.",
    mtp_count_field="num_nextn_predict_layers",
)

# transformers 5's names of the blocks (`layers_block_type`, what it writes when it saves), by symbol.
HF_BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# What megatron-core's MambaMixer fixes (its convolution's taps and bias, its scan's chunk, its activation, no bias on
# its projections: `use_bias` is theirs in transformers), by the config field that could say otherwise.
FIXED_BY_MEGATRON_CORE = {
    "conv_kernel": 4, "chunk_size": 128, "mamba_hidden_act": "silu", "use_conv_bias": True, "mamba_proj_bias": False,
    "use_bias": False,
}
# What the family's other blocks are as converted: relu^2 MLPs, no biases.
CONVERTED = {"mlp_hidden_act": "relu2", "attention_bias": False, "mlp_bias": False}
# megatron-core's gated RMSNorm in the Mamba mixer has epsilon 1e-5 whatever the model's; transformers uses
# layer_norm_epsilon for both.
MAMBA_NORM_EPS = 1e-5


def layer_blocks(config: dict[str, Any], source: str, field: str = "hybrid_override_pattern", kinds_field: str = "layers_block_type") -> str:
    """The blocks as symbols: from `hybrid_override_pattern` (hub configs) or `layers_block_type` (transformers 5's);
    an MTP layer's from `mtp_hybrid_override_pattern` or `mtp_layers_block_type`."""
    pattern = config.get(field)
    if pattern is None:
        kinds = config.get(kinds_field)
        if not isinstance(kinds, list) or set(kinds) - set(HF_BLOCK_TYPES.values()):
            raise ConversionError(f"{source}: neither {field} nor {kinds_field} names the layers ({kinds!r})")
        pattern = "".join({hf: symbol for symbol, hf in HF_BLOCK_TYPES.items()}[kind] for kind in kinds)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(HF_BLOCK_TYPES):
        raise ConversionError(f"{source}: {field} {pattern!r} is not made of M, *, - and E")
    return pattern


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    for name, fixed in FIXED_BY_MEGATRON_CORE.items():
        if config.get(name, fixed) != fixed:
            raise ConversionError(f"{source}: {name} {config[name]!r}: megatron-core's Mamba mixer has {fixed!r} only")
    for name, converted in CONVERTED.items():
        if config.get(name, converted) != converted:
            raise ConversionError(f"{source}: {name} {config[name]!r}: nemotron_h converts {converted!r} only")
    eps = float(config.get("layer_norm_epsilon", config.get("norm_eps", 1e-5)))
    if eps != MAMBA_NORM_EPS:
        raise ConversionError(f"{source}: layer_norm_epsilon {eps:g}: megatron-core's Mamba mixer normalises with {MAMBA_NORM_EPS:g} only")
    blocks = layer_blocks(config, source)
    # transformers' blocks of an MTP layer where the config names none: attention, then experts.
    mtp_default = {"mtp_layers_block_type": [HF_BLOCK_TYPES["*"], HF_BLOCK_TYPES["E"]]}
    mtp_blocks = layer_blocks({**mtp_default, **config}, source, "mtp_hybrid_override_pattern", "mtp_layers_block_type") \
        if config.get("num_nextn_predict_layers") else None
    mamba = MambaSpec(
        num_heads=require(config, "mamba_num_heads", source),
        head_dim=require(config, "mamba_head_dim", source),
        num_groups=require(config, "n_groups", source),
        state_dim=require(config, "ssm_state_size", source),
    )
    if mamba.num_heads % mamba.num_groups:
        raise ConversionError(f"{source}: n_groups {mamba.num_groups} does not divide mamba_num_heads {mamba.num_heads}")
    spec = read_dense_spec(
        {**config, "num_hidden_layers": len(blocks), "hidden_act": "silu"}, "nemotron_h", source,
        norm_eps=eps, activation="squared_relu", layer_blocks=blocks, mtp_blocks=mtp_blocks, mamba=mamba, position_embeddings="none",
        sliding_window=None, hf_config=dict(config),
        computed_differently=(
            f"transformers clamps the Mamba layers' dt at time_step_min {config.get('time_step_min', 0.001):g} in a forward "
            "over a whole prompt; megatron-core does not",
        ),
    )
    if "E" in blocks:
        moe = deepseek.read_moe({"n_shared_experts": 1, **config}, spec.num_layers, True, source)
        spec = dataclasses.replace(spec, moe=dataclasses.replace(
            moe, moe_layers=tuple(symbol == "E" for symbol in blocks),
            shared_expert_ffn_hidden_size=require(config, "moe_shared_expert_intermediate_size", source),
            latent_size=require(config, "moe_latent_size", source) if config.get("moe_latent_size") is not None else None,
        ))
    return spec


def write_config(spec: ModelSpec) -> dict[str, Any]:
    if spec.layer_blocks is None or spec.mamba is None or spec.activation != "squared_relu" or spec.position_embeddings != "none":
        raise ConversionError(
            "the nemotron_h family has Mamba layers beside attention without position embeddings and MLPs without a gate, one block a layer"
        )
    config = write_dense_config(spec, "nemotron_h", "NemotronHForCausalLM")
    for name in ("hidden_act", "rms_norm_eps"):
        config.pop(name, None)
    mamba = spec.mamba
    config.update(
        hybrid_override_pattern=spec.layer_blocks,
        layers_block_type=[HF_BLOCK_TYPES[symbol] for symbol in spec.layer_blocks],  # what transformers 5 reads first
        mamba_num_heads=mamba.num_heads,
        mamba_head_dim=mamba.head_dim,
        n_groups=mamba.num_groups,
        ssm_state_size=mamba.state_dim,
        layer_norm_epsilon=spec.norm_eps,
        **{name: value for name, value in {**FIXED_BY_MEGATRON_CORE, **CONVERTED}.items() if value is not None},
        num_nextn_predict_layers=spec.mtp_layers,
    )
    if spec.mtp_layers:
        config.update(mtp_hybrid_override_pattern=spec.mtp_blocks, mtp_layers_block_type=[HF_BLOCK_TYPES[s] for s in spec.mtp_blocks])
    moe = spec.moe
    if moe is not None:
        if moe.score_function != "sigmoid" or not moe.expert_bias or not moe.shared_expert_ffn_hidden_size or moe.shared_expert_gate:
            raise ConversionError("the nemotron_h family routes by sigmoid scores with an expert bias, beside one ungated shared expert")
        config.update(
            n_routed_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.ffn_hidden_size,
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            n_shared_experts=1,
            routed_scaling_factor=moe.topk_scaling_factor or 1.0,
            n_group=moe.num_groups or 1,
            topk_group=moe.group_topk or 1,
            norm_topk_prob=True,
            moe_latent_size=moe.latent_size,
        )
    return config


FAMILY = Family(
    name="nemotron_h",
    model_types=("nemotron_h",),
    model_sizes=("nemotron-h", "nemotron-nano", "nemotron-3"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("NemotronHForCausalLM", "nemotron_h"),),
)
