"""OLMo 2 (`olmo2`, transformers' Olmo2ForCausalLM): Llama's tensors with the norms moved after the attention and
the MLP, each on its sublayer's output before the residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`; no norm before either), and MiniMax-M2's q/k norms over all heads of the layer.

megatron-core's layers have norms before their sublayers only: OLMo 2's layer is mconvert's layer spec
(mconvert.megatron_lm.layer_specs.with_norms_after_sublayers, which Megatron-LM loads by `--spec`), whose norms after
the sublayers are part of the row-parallel linear that ends each (`linear_proj`, `linear_fc2`), stored as its
`post_layernorm.weight` (Megatron-Bridge's names for the same norms, so that the checkpoints agree).
"""

from __future__ import annotations

from typing import Any

from mconvert.mappings import llama, minimax_m2
from mconvert.mappings.family import Family, Table
from mconvert.mappings.spec import ModelSpec, read_dense_spec, write_dense_config
from mconvert.mappings.splits import Replicated
from mconvert.mappings.transforms import Rename

# Llama's norms before the attention and the MLP, which OLMo 2 does not have.
NORMS_BEFORE = ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
# Its norms after them: whole on every tensor-parallel rank, as the sublayers' outputs are.
NORM_AFTER_ATTENTION = Rename("self_attention.linear_proj.post_layernorm.weight", "post_attention_layernorm.weight", split=Replicated("hidden_size"))
NORM_AFTER_MLP = Rename("mlp.linear_fc2.post_layernorm.weight", "post_feedforward_layernorm.weight", split=Replicated("hidden_size"))
ATTENTION = (*(entry for entry in minimax_m2.ATTENTION if entry.mcore not in NORMS_BEFORE), NORM_AFTER_ATTENTION)
DENSE_MLP = (*(entry for entry in llama.DENSE_MLP if entry.mcore not in NORMS_BEFORE), NORM_AFTER_MLP)

TABLE = Table(model=llama.MODEL, attention=ATTENTION, dense_mlp=DENSE_MLP)

# What transformers' Olmo2Config (and Olmo3Config) assume where config.json says nothing.
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048}


def read_dense_olmo_spec(config: dict[str, Any], family: str, source: str, **overrides: Any) -> ModelSpec:
    """The fields OLMo 2 and OLMo 3 share. Their MLP has no biases whatever the config says (`attention_bias` puts
    biases on q, k, v and o only, which Megatron cannot express: refused)."""
    return read_dense_spec(
        {**DEFAULTS, **config, "mlp_bias": False}, family, source, applies_sliding_window=False,
        qk_norm=True, qk_norm_across_heads=True, norms_before_sublayers=False, norms_after_sublayers=True, **overrides,
    )


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    return read_dense_olmo_spec(config, "olmo2", source)


def write_config(spec: ModelSpec) -> dict[str, Any]:
    return write_dense_config(spec, "olmo2", "Olmo2ForCausalLM")


FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    model_sizes=("olmo2", "olmo-2"),
    table=TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Olmo2ForCausalLM", "olmo2"),),
)
