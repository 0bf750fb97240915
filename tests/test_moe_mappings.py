"""MoE config reading and writing: the fields each family uses, both config styles, dense layers mixed in,
missing fields, and write_config as the exact inverse of read_config. transformers is the reference for what a
config means."""

from __future__ import annotations

import pytest
import torch
import transformers

from mconvert.errors import ConversionError
from mconvert.mappings import FAMILIES, family_for_model_size, get_mapping
from mconvert.synthetic import real_config, shrink

MOE_CONFIGS = {"qwen3_moe": "qwen3-30b-a3b", "qwen2_moe": "qwen1.5-moe-a2.7b", "mixtral": "mixtral-8x7b-v0.1",
               "olmoe": "olmoe-1b-7b-0924"}


def v5_style(config: dict) -> dict:
    """The config.json transformers v5 writes for `config` (rope_parameters, Qwen3-MoE's num_local_experts)."""
    return transformers.AutoConfig.for_model(**config).to_dict()


def hf_sparse_layers(config: dict) -> list[bool]:
    """Which layers transformers builds with experts."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    return [hasattr(layer.mlp, "experts") for layer in model.model.layers]


def test_real_configs():
    qwen3 = get_mapping(real_config("qwen3-30b-a3b"))[1]
    assert (qwen3.family, qwen3.qk_norm, qwen3.qkv_bias, qwen3.rope_theta) == ("qwen3_moe", True, False, 1e6)
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.ffn_hidden_size) == (128, 8, 768)
    assert all(qwen3.moe.moe_layers) and len(qwen3.moe.moe_layers) == 48
    assert not qwen3.moe.router_pre_softmax and qwen3.moe.shared_expert_ffn_hidden_size is None

    qwen2 = get_mapping(real_config("qwen1.5-moe-a2.7b"))[1]
    assert (qwen2.family, qwen2.qkv_bias, qwen2.linear_bias, qwen2.qk_norm) == ("qwen2_moe", True, False, False)
    assert (qwen2.moe.num_experts, qwen2.moe.top_k, qwen2.moe.ffn_hidden_size) == (60, 4, 1408)
    assert (qwen2.moe.shared_expert_ffn_hidden_size, qwen2.moe.shared_expert_gate) == (5632, True)
    assert qwen2.moe.router_pre_softmax  # norm_topk_prob false

    mixtral = get_mapping(real_config("mixtral-8x7b-v0.1"))[1]
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.ffn_hidden_size) == (8, 2, 14336)
    assert all(mixtral.moe.moe_layers) and not mixtral.moe.router_pre_softmax
    assert (mixtral.num_query_groups, mixtral.norm_eps) == (8, 1e-5)


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_both_config_styles_read_alike(family):
    hub = shrink(real_config(MOE_CONFIGS[family]))
    v5 = v5_style(hub)
    assert "rope_parameters" in v5 and "rope_theta" not in v5
    assert get_mapping(hub)[1] == get_mapping(v5)[1]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mlp_only_layers=[0, 3]),
        dict(decoder_sparse_step=2),
        dict(decoder_sparse_step=3, mlp_only_layers=[5]),
    ],
    ids=["mlp_only_layers", "sparse_step", "both"],
)
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_dense_layers_where_transformers_puts_them(family, overrides):
    config = shrink(real_config(MOE_CONFIGS[family]), layers=6, **overrides)
    spec = get_mapping(config)[1]
    assert list(spec.moe.moe_layers) == hf_sparse_layers(config)
    assert not spec.uniform_layers


def test_mixtral_default_rope_theta_is_its_own():
    config = shrink(real_config("mixtral-8x7b-v0.1"))
    del config["rope_theta"]
    assert get_mapping(config)[1].rope_theta == transformers.MixtralConfig(**config).rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize(
    "family, field",
    [
        ("qwen3_moe", "num_experts"),
        ("qwen3_moe", "num_experts_per_tok"),
        ("qwen3_moe", "moe_intermediate_size"),
        ("qwen2_moe", "shared_expert_intermediate_size"),
        ("qwen2_moe", "num_experts"),
        ("mixtral", "num_local_experts"),
        ("mixtral", "num_experts_per_tok"),
    ],
)
def test_missing_moe_field_is_named(family, field):
    config = shrink(real_config(MOE_CONFIGS[family]))
    del config[field]
    with pytest.raises(ConversionError, match=f"'{field}' is missing"):
        get_mapping(config)


def test_no_layer_with_experts_is_an_error():
    config = shrink(real_config("qwen3-30b-a3b"), mlp_only_layers=[0, 1])
    with pytest.raises(ConversionError, match="no layer has experts"):
        get_mapping(config)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen3_moe", dict(layers=4, mlp_only_layers=[0, 3])),
        ("qwen3_moe", dict(norm_topk_prob=False)),
        ("qwen2_moe", dict(layers=4, decoder_sparse_step=2, norm_topk_prob=True)),
        ("mixtral", dict(rope_theta=5e5, tie_word_embeddings=True)),
        ("olmoe", dict(norm_topk_prob=True, num_key_value_heads=2)),
    ],
)
def test_write_config_round_trips(family, overrides):
    layers = overrides.pop("layers", 2)
    original = shrink(real_config(MOE_CONFIGS[family]), layers=layers, **overrides)
    for config in (original, v5_style(original)):
        spec = get_mapping(config)[1]
        written = FAMILIES[family].write_config(spec)
        assert get_mapping(written)[1] == spec
        # transformers builds the same model from the written config as from the original one.
        assert hf_sparse_layers(written) == hf_sparse_layers(original)
        with torch.device("meta"):
            shapes = [
                {name: p.shape for name, p in transformers.AutoModelForCausalLM.from_config(
                    transformers.AutoConfig.for_model(**c)).named_parameters()}
                for c in (original, written)
            ]
        assert shapes[0] == shapes[1]


def test_write_config_refuses_what_the_family_cannot_hold():
    qwen2 = get_mapping(shrink(real_config("qwen1.5-moe-a2.7b")))[1]
    with pytest.raises(ConversionError, match="qwen3_moe"):
        FAMILIES["qwen3_moe"].write_config(qwen2)
    with pytest.raises(ConversionError, match="mixtral"):
        FAMILIES["mixtral"].write_config(qwen2)


@pytest.mark.parametrize(
    "model_size, family",
    [
        ("qwen3-moe-30B-A3B", "qwen3_moe"),
        ("qwen3-8B", "qwen3"),
        ("qwen2-moe", "qwen2_moe"),
        ("qwen1.5-moe-a2.7b", "qwen2_moe"),
        ("qwen2.5-7B", "qwen2"),
        ("mixtral-8x7B", "mixtral"),
        ("mistral-7B", "llama"),
    ],
)
def test_model_size_names_the_family(model_size, family):
    assert family_for_model_size(model_size).name == family
