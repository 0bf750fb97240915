"""Qwen3.5 and Qwen3.6, dense and MoE: Qwen3-Next's layers (gated delta-net beside gated full attention,
zero-centred norms, partial rope), with the delta-net's input projections stored one by one (`in_proj_qkv`
flat [q; k; v], `in_proj_z`, `in_proj_b`, `in_proj_a`) and every MoE layer's routed experts fused on the hub
(`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; transformers' save_pretrained writes them one by
one), top k always renormalised.

They ship as image-text checkpoints (`Qwen3_5ForConditionalGeneration`): the language model under
`model.language_model.` and its config under `text_config`, beside a vision tower (`model.visual.`) that a
Megatron GPT checkpoint does not hold. The text-only classes (`qwen3_5_text`, `qwen3_5_moe_text`) name the same
model under `model.`. Rope is multimodal (`mrope_section`); for text, whose three position ids are equal, it
is the plain rope of its theta over the rotated part of each head."""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import qwen2_moe, qwen3_next
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config
from mconvert.mappings.splits import Column, Replicated, Sectioned, Vocabulary
from mconvert.mappings.transforms import Rename, Section

LINEAR_ATTENTION = qwen3_next.DELTA_NET_REST + (
    *(Section(f"self_attention.in_proj.weight.{name}", "linear_attn.in_proj_qkv.weight", sections=qwen3_next.flat_qkv, section=name,
              split=Sectioned("hidden_size"))
      for name in ("query", "key", "value")),
    Rename("self_attention.in_proj.weight.z", "linear_attn.in_proj_z.weight", split=Column("linear_attention.value_dim", "hidden_size")),
    Rename("self_attention.in_proj.weight.beta", "linear_attn.in_proj_b.weight", split=Column("linear_attention.value_heads", "hidden_size")),
    Rename("self_attention.in_proj.weight.alpha", "linear_attn.in_proj_a.weight", split=Column("linear_attention.value_heads", "hidden_size")),
)

# Qwen3-Next's table with the delta-net's projections one by one; the experts are read fused (as the hub has them)
# or one by one (as transformers' save_pretrained writes them), and written fused unless the checkpoint --hf-config
# names holds them one by one.
TEXT_TABLE = dataclasses.replace(
    qwen3_next.TABLE,
    linear_attention=LINEAR_ATTENTION,
    hub_experts_fused=True,
    left_out=(("model.visual.", "the vision tower"),),
)

# The image-text checkpoints: the same language model one level down.
TABLE = dataclasses.replace(
    TEXT_TABLE,
    model=(
        Rename("embedding.word_embeddings.weight", "model.language_model.embed_tokens.weight", split=Vocabulary()),
        Rename("decoder.final_layernorm.weight", "model.language_model.norm.weight", split=Replicated("hidden_size")),
        Rename("output_layer.weight", "lm_head.weight", when="untie_embeddings", split=Vocabulary()),
    ),
    layer_prefix="model.language_model.layers.{layer}.",
    copied_back=("model.visual.",),
)

TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def read_text_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    if config.get("num_experts") and config.get("intermediate_size") is None:
        # Every layer has experts: Megatron's --ffn-hidden-size, required, is theirs.
        config = {**config, "intermediate_size": config.get("moe_intermediate_size")}
    spec = qwen3_next.read_linear_attention(config, read_dense_spec(config, "qwen3_5_text", source), source)
    if config.get("num_experts"):
        # transformers' Qwen3.5-MoE renormalises the top k whatever norm_topk_prob says, in every layer.
        spec = qwen3_next.read_moe({**config, "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}, spec, source)
    return dataclasses.replace(spec, family="qwen3_5_text")


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """An image-text checkpoint's language model (`text_config`); the outer config is kept for the export."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"{source}: model_type '{config.get('model_type')}' has no text_config object")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    spec = read_text_config({**text, "tie_word_embeddings": tied, "model_type": TEXT_MODEL_TYPES.get(config.get("model_type"), "qwen3_5_text")}, source)
    return dataclasses.replace(spec, family="qwen3_5", hf_config=dict(config))


def write_text_config(spec: ModelSpec) -> dict[str, Any]:
    qwen3_next.check_linear_attention(spec, "qwen3_5")
    moe = spec.moe
    model_type, architecture = ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM") if moe else ("qwen3_5_text", "Qwen3_5ForCausalLM")
    config = write_dense_config(spec, model_type, architecture)
    if moe is not None:
        if not all(moe.moe_layers) or not moe.shared_expert_gate or moe.router_pre_softmax:
            raise ConversionError("the qwen3_5 family has experts in every layer, a gated shared expert and the top k renormalised")
        config = qwen2_moe.write_qwen_moe(config, spec)
        config.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size)
        for name in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            config.pop(name)
    # Rope as these configs state it: rope_parameters, with the multimodal sections of the source.
    rope = dict(spec.hf_config.get("rope_parameters") or {"rope_type": "default"})
    rope.update(rope_theta=spec.rope_theta, partial_rotary_factor=spec.rotary_percent)
    for name in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        config.pop(name, None)
    config["rope_parameters"] = rope
    return qwen3_next.write_linear_attention(config, spec)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    outer = dict(spec.hf_config)
    text = write_text_config(dataclasses.replace(spec, hf_config=dict(outer.get("text_config") or {})))
    moe = spec.moe is not None
    outer.update(
        text_config=text,
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        architectures=["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        tie_word_embeddings=not spec.untie_embeddings,
    )
    return outer


FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_moe"),
    model_sizes=("qwen3.5", "qwen3.6"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Qwen3_5ForConditionalGeneration", "qwen3_5"), ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")),
)

TEXT_FAMILY = Family(
    name="qwen3_5_text",
    model_types=("qwen3_5_text", "qwen3_5_moe_text"),
    model_sizes=("qwen3.5-text", "qwen3.6-text"),
    table=TEXT_TABLE,
    read_config=read_text_config,
    write_config=write_text_config,
    architectures=(("Qwen3_5ForCausalLM", "qwen3_5_text"), ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")),
)
