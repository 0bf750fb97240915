"""DeepSeek-V2/V3 and GLM-4.5 configs, and those of the models with their experts (GLM-4.7-Flash, dots.llm1, Hy3),
into Megatron-LM flags (spellings and types Megatron-LM 0.19.2's parser takes: checked there with
mconvert.verify.megatron_lm.parse_megatron_lm_args), and the configs megatron-core cannot express refused with the
field named."""

from __future__ import annotations

import pytest
import torch

from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.megatron_lm.flags import megatron_flags, settings_without_flags
from mconvert.synthetic import real_config


def flags_of(config: dict) -> list[str]:
    _, spec = get_mapping(config)
    return megatron_flags(megatron_args(spec, Parallelism(tp=8, ep=8), torch.bfloat16, "transformer_engine"))


def test_deepseek_v3_flags():
    flags = flags_of(real_config("deepseek-v3"))
    for flag in (
        "--multi-latent-attention", "--q-lora-rank 1536", "--kv-lora-rank 512", "--qk-head-dim 128",
        "--qk-pos-emb-head-dim 64", "--v-head-dim 128", "--qk-layernorm", "--rope-type yarn",
        "--rotary-scaling-factor 40", "--mscale 1", "--mscale-all-dim 1", "--moe-router-score-function sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor 2.5", "--moe-router-num-groups 8",
        "--moe-router-group-topk 4", "--moe-shared-expert-intermediate-size 2048", "--num-experts 256",
        "--moe-layer-freq '[0,0,0" + ",1" * 58 + "]'",
    ):
        assert flag in flags, flag
    assert not any(flag.startswith("--group-query-attention") for flag in flags)


def test_deepseek_v2_lite_and_glm_flags():
    v2 = flags_of(real_config("deepseek-v2-lite"))
    assert "--moe-router-pre-softmax" in v2 and "--mscale-all-dim 0.707" in v2
    assert not any(flag.startswith(("--q-lora-rank", "--moe-router-score-function", "--moe-router-num-groups")) for flag in v2)
    glm = flags_of(real_config("glm-4.5-air"))
    for flag in ("--rotary-percent 0.5", "--add-qkv-bias", "--disable-bias-linear", "--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias"):
        assert flag in glm, flag
    assert "--multi-latent-attention" not in glm and "--qk-layernorm" not in glm


def test_glm_47_flash_flags():
    """The real config: a dense first layer by mlp_layer_types' default (first_k_dense_replace unread), no groups, the
    latent norms' epsilon said, and no rope fusion (megatron-core refuses it under MLA without YaRN)."""
    glm = flags_of(real_config("glm-4.7-flash"))
    for flag in ("--multi-latent-attention", "--q-lora-rank 768", "--kv-lora-rank 512", "--qk-head-dim 192", "--qk-pos-emb-head-dim 64",
                 "--v-head-dim 256", "--moe-router-score-function sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-topk-scaling-factor 1.8", "--moe-shared-expert-intermediate-size 1536", "--rope-type rope",
                 "--no-rope-fusion", "--moe-layer-freq '[0" + ",1" * 46 + "]'"):
        assert flag in glm, flag
    assert not any(flag.startswith("--moe-router-num-groups") for flag in glm)
    assert "latents with epsilon 1e-06" in get_mapping(real_config("glm-4.7-flash"))[1].computed_differently[0]


def test_dots1_flags():
    """The real config: q/k norms, two shared experts, no window, no groups."""
    dots1 = flags_of(real_config("dots.llm1.inst"))
    for flag in ("--qk-layernorm", "--moe-router-topk-scaling-factor 2.5", "--moe-shared-expert-intermediate-size 2816",
                 "--num-experts 128", "--moe-router-topk 6", "--rotary-base 10000000", "--moe-layer-freq '[0" + ",1" * 61 + "]'"):
        assert flag in dots1, flag
    assert not any(flag.startswith(("--window-size", "--moe-router-num-groups", "--add-qkv-bias", "--rotary-percent")) for flag in dots1)


def test_dots1_windows_are_read_as_transformers_reads_them():
    """From max_window_layers on where sliding_window is set, whatever use_sliding_window says (its configs say false)."""
    _, spec = get_mapping({**real_config("dots.llm1.inst"), "sliding_window": 4096, "max_window_layers": 60})
    assert spec.sliding_window == 4096 and spec.sliding_layers == (False,) * 60 + (True,) * 2
    assert "--window-attn-skip-freq '[" + "0," * 60 + "1,1]'" in flags_of({**real_config("dots.llm1.inst"), "sliding_window": 4096, "max_window_layers": 60})
    assert get_mapping({**real_config("dots.llm1.inst"), "sliding_window": 4096})[1].sliding_window is None  # max_window_layers 62 of 62


def test_hy3_flags():
    """The real config: q/k norms, its scaling factor and rope theta, a dense first layer by mlp_layer_types' default,
    no groups."""
    hy3 = flags_of(real_config("hy3-preview"))
    for flag in ("--qk-layernorm", "--moe-router-topk-scaling-factor 2.826", "--moe-shared-expert-intermediate-size 1536",
                 "--num-experts 192", "--moe-router-topk 8", "--rotary-base 11158840", "--kv-channels 128",
                 "--moe-layer-freq '[0" + ",1" * 79 + "]'"):
        assert flag in hy3, flag
    assert not any(flag.startswith(("--window-size", "--moe-router-num-groups", "--add-qkv-bias", "--rotary-percent")) for flag in hy3)


def test_unscaled_mla_rope_is_plain_rope():
    config = {**real_config("deepseek-v3"), "rope_scaling": None}
    flags = flags_of(config)
    assert "--rope-type rope" in flags and "--rotary-scaling-factor 1" in flags


def test_mla_yarn_settings_without_flags_are_kept_and_named():
    """YaRN's betas and original length under multi-latent attention are MLATransformerConfig fields that
    Megatron-LM's command line cannot set: the model converts, its args hold them, and what to set is said."""
    rope = {"type": "yarn", "factor": 40, "beta_fast": 16, "beta_slow": 2, "mscale": 1, "mscale_all_dim": 1, "original_max_position_embeddings": 4096}
    _, spec = get_mapping({**real_config("deepseek-v3"), "rope_scaling": rope})
    args = megatron_args(spec, Parallelism(), torch.bfloat16, "transformer_engine")
    assert (args.beta_fast, args.beta_slow, args.original_max_position_embeddings) == (16.0, 2.0, 4096)
    (setting,) = settings_without_flags(args)
    assert setting.startswith("YaRN's beta_fast=16, beta_slow=2: ") and "MLATransformerConfig(beta_fast=16, beta_slow=2)" in setting
    assert not settings_without_flags(megatron_args(get_mapping(real_config("deepseek-v3"))[1], Parallelism(), torch.bfloat16, "local"))


@pytest.mark.parametrize(
    "model, changes, message",
    [
        ("deepseek-v3", {"norm_topk_prob": False}, "sigmoid routing with norm_topk_prob False"),
        ("glm-4.5-air", {"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        ("deepseek-v3", {"topk_group": 2}, "best 4 experts in Megatron but by their best 2"),
        ("deepseek-v2-lite", {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}, "best 2 experts in Megatron but by their best 1"),
        ("deepseek-v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek-v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek-v3", {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.7}}, "mscale 0.7 without mscale_all_dim"),
        ("deepseek-v3", {"rope_scaling": {"type": "linear", "factor": 2}}, "'linear' cannot be expressed with multi-latent attention"),
        ("glm-4.7-flash", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ("glm-4.7-flash", {"mlp_layer_types": ["dense"] * 47}, "no layer has experts"),
        ("glm-4.7-flash", {"mlp_layer_types": ["sparse"] * 46}, "mlp_layer_types"),
        ("dots.llm1.inst", {"attention_bias": True}, "attention_bias puts biases on q, k, v and o but not on the MLPs"),
        ("dots.llm1.inst", {"norm_topk_prob": False}, "sigmoid routing with norm_topk_prob False"),
        ("hy3-preview", {"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        ("hy3-preview", {"mlp_bias": True, "attention_bias": True}, "Hy3's experts have no biases"),
    ],
    ids=["sigmoid-unnormalised", "sigmoid-top1", "v3-group-score", "v2-group-score", "mla-bias", "not-interleaved", "lone-mscale", "mla-linear-rope",
         "glm-lite-partial-rope", "glm-lite-no-experts", "glm-lite-layer-types", "dots1-bias", "dots1-unnormalised", "hy3-top1", "hy3-bias"],
)
def test_what_megatron_cannot_express_is_refused(model, changes, message):
    with pytest.raises(ConversionError, match=message):
        flags_of({**real_config(model), **changes})


def test_a_norm_epsilon_apart_from_the_latent_norms_is_converted_and_said():
    """transformers' MLA latent norms keep epsilon 1e-6 whatever rms_norm_eps says (GLM-5.1: 1e-5); megatron-core has
    one for all norms. Converted, with the difference said (its effect is measured in tests/megatron_lm)."""
    assert get_mapping(real_config("deepseek-v3"))[1].computed_differently == ()
    (said,) = get_mapping({**real_config("deepseek-v3"), "rms_norm_eps": 1e-5})[1].computed_differently
    assert "latents with epsilon 1e-06" in said and "rms_norm_eps 1e-05" in said


def test_deepseek_v32_and_glm_51_flags():
    """The real configs: the indexer's sizes, GLM-5.1's interleaved indexer rope and its key norm's own epsilon."""
    deepseek = flags_of(real_config("deepseek-v3.2"))
    glm = flags_of(real_config("glm-5.1"))
    for flags in (deepseek, glm):
        for flag in ("--experimental-attention-variant dsa", "--dsa-indexer-head-dim 128", "--dsa-indexer-topk 2048",
                     "--no-dsa-indexer-rotate-activation", "--sequence-parallel", "--multi-latent-attention", "--qk-layernorm"):
            assert flag in flags, flag
    assert "--dsa-indexer-n-heads 64" in deepseek and "--dsa-indexer-n-heads 32" in glm
    assert "--dsa-indexer-rope-interleaved" in glm and "--dsa-indexer-rope-interleaved" not in deepseek
    assert "--dsa-indexer-k-norm-epsilon 1e-06" in glm and not any(f.startswith("--dsa-indexer-k-norm-epsilon") for f in deepseek)
    assert "--qk-head-dim 192" in glm and "--v-head-dim 256" in glm and "--rotary-base 1000000" in glm


def test_sparse_attention_under_the_local_spec_is_refused():
    _, spec = get_mapping(real_config("deepseek-v3.2"))
    with pytest.raises(ConversionError, match="--transformer-impl local: megatron-core builds sparse-attention layers only under transformer_engine"):
        megatron_args(spec, Parallelism(), torch.bfloat16, "local")


def test_verify_under_megatron_core_016_refuses_sparse_attention_in_one_line(hf_model_factory, tmp_path):
    """megatron-core 0.16.1's indexer always rotates q and k by a Hadamard matrix (bf16 and fast-hadamard-transform
    only) and has no interleaved rope: verify says to use 0.19 (tests/megatron_lm/test_sparse_attention.py)."""
    from tests.cli_runner import assert_one_line_error, run_cli

    hf = hf_model_factory("deepseek-v3.2")
    assert run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore").returncode == 0
    failed = run_cli("verify", "--hf", hf, "--mcore", tmp_path / "mcore", "--device", "cpu")
    assert_one_line_error(failed, "sparse attention", "megatron-core 0.16.1", "0.19", code=2)
