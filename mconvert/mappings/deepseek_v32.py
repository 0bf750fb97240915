"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5.1 (`glm_moe_dsa`): DeepSeek-V3's multi-latent attention and
experts, plus DeepSeek Sparse Attention, megatron-core's `dsa` attention variant. Each layer's lightning
indexer scores the earlier tokens from the query latent (wq_b) and the layer's input (wk, a LayerNorm with bias,
weights_proj), and attention keeps the best `index_topk`.

The indexer's tensors are megatron-core's DSAIndexer parameters as they are: its rope rotates the first
qk_rope_head_dim dims of each head, interleaved pairs (GLM-5.1's `indexer_rope_interleave`) or the two halves
(DeepSeek-V3.2), which megatron-core's `dsa_indexer_rope_interleaved` says, so no rows move. DeepSeek's
reference rotates q and k by a Hadamard matrix before scoring; transformers does not, as the rotation is
orthogonal and leaves every score as it is: the flags turn it off (it needs bf16 and fast-hadamard-transform).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import deepseek
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec, SparseAttentionSpec, require, shared_top_k_schedule
from mconvert.mappings.splits import Replicated
from mconvert.mappings.transforms import Rename


def _query_width(spec: ModelSpec) -> int:
    """wq_b's output: every indexer head's query."""
    return spec.sparse_attention.index_heads * spec.sparse_attention.index_head_dim


# The indexer: every tensor whole on every TP rank.
INDEXER = tuple(
    Rename(f"self_attention.core_attention.indexer.{mcore}", f"self_attn.indexer.{hf}", split=Replicated(*dims))
    for mcore, hf, dims in (
        ("linear_wq_b.weight", "wq_b.weight", (_query_width, "mla.q_lora_rank")),
        ("linear_wk.weight", "wk.weight", ("sparse_attention.index_head_dim", "hidden_size")),
        ("k_norm.weight", "k_norm.weight", ("sparse_attention.index_head_dim",)),
        ("k_norm.bias", "k_norm.bias", ("sparse_attention.index_head_dim",)),
        ("linear_weights_proj.weight", "weights_proj.weight", ("sparse_attention.index_heads", "hidden_size")),
    )
)

# Megatron-LM 0.19.2's model builder builds no multi-token prediction block beside an attention variant (its
# mtp_block_spec asks get_gpt_decoder_layer_specs, which refuses one).
MTP_LEFT_OUT = "Megatron-LM 0.19.2 builds none beside sparse attention in GPTModel; --model-class hybrid converts them"

TABLE = dataclasses.replace(deepseek.TABLE, indexer=INDEXER, mtp_left_out=MTP_LEFT_OUT)

MODEL_TYPES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def read_indexer_layers(config: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    """Which layers run their own indexer, as transformers' GLM-MoE-DSA reads it (`indexer_types`, else
    `index_topk_pattern`, else `index_topk_freq` from `index_skip_topk_offset`, 2 by default); all for DeepSeek-V3.2."""
    if FAMILY.hf_model_type(config) != "glm_moe_dsa":
        return (True,) * num_layers
    kinds = config.get("indexer_types")
    if kinds is None and (pattern := config.get("index_topk_pattern")) is not None:
        kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        freq, offset = max(config.get("index_topk_freq", 1), 1), config.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {"full", "shared"} or kinds[0] != "full":
        raise ConversionError(f"{source}: indexer_types {kinds} is not 'full' or 'shared' per layer, starting with 'full'")
    layers = tuple(kind == "full" for kind in kinds)
    if shared_top_k_schedule(layers) is None:
        raise ConversionError(
            f"{source}: indexer_types {kinds} shares top-k on layers that no dsa_indexer_topk_freq and "
            f"dsa_indexer_skip_topk_offset of megatron-core select"
        )
    return layers


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    model_type = FAMILY.hf_model_type(config)
    if config.get("q_lora_rank") is None:
        raise ConversionError(f"{source}: sparse attention without q_lora_rank (its indexer reads the query latent) is not supported")
    spec = deepseek.read_mla_model(config, "deepseek_v32", sigmoid=True, source=source)
    sparse = SparseAttentionSpec(
        index_heads=require(config, "index_n_heads", source),
        index_head_dim=require(config, "index_head_dim", source),
        topk=require(config, "index_topk", source),
        # What transformers' indexers do, whatever the config says: GLM-MoE-DSA's rotates pairs, DeepSeek-V3.2's halves.
        rope_interleaved=model_type == "glm_moe_dsa",
        indexer_layers=read_indexer_layers(config, spec.num_layers, source),
    )
    if sparse.index_head_dim < spec.mla.qk_pos_emb_head_dim:
        raise ConversionError(f"{source}: index_head_dim {sparse.index_head_dim} is narrower than qk_rope_head_dim {spec.mla.qk_pos_emb_head_dim}")
    return dataclasses.replace(spec, sparse_attention=sparse)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    sparse = spec.sparse_attention
    if sparse is None or spec.mla is None or spec.mla.q_lora_rank is None:
        raise ConversionError(f"the {spec.family} family has sparse attention beside multi-latent attention with q_lora_rank")
    model_type = spec.hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        model_type = "glm_moe_dsa" if sparse.rope_interleaved or not all(sparse.indexer_layers) else "deepseek_v32"
    config = deepseek.write_config(dataclasses.replace(spec, sparse_attention=None))
    for name in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "rope_interleave"):
        config.pop(name, None)
    config.update(
        model_type=model_type,
        architectures=[MODEL_TYPES[model_type]],
        index_n_heads=sparse.index_heads,
        index_head_dim=sparse.index_head_dim,
        index_topk=sparse.topk,
        num_nextn_predict_layers=0,
    )
    if model_type == "glm_moe_dsa":
        config.update(
            indexer_rope_interleave=sparse.rope_interleaved,
            indexer_types=["full" if runs else "shared" for runs in sparse.indexer_layers],
        )
    return config


FAMILY = Family(
    name="deepseek_v32",
    model_types=tuple(MODEL_TYPES),
    model_sizes=("deepseek-v3.2", "deepseek-v32", "glm-5", "glm5"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=tuple((architecture, model_type) for model_type, architecture in MODEL_TYPES.items()),
)
