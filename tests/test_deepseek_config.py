"""DeepSeek-V2/V3 and GLM-4.5 configs into Megatron-LM flags (spellings and types Megatron-LM 0.19.2's parser
takes: checked there with mconvert.verify.megatron_lm.parse_megatron_lm_args), and the configs megatron-core
cannot express refused with the field named."""

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
        ("deepseek-v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
        ("deepseek-v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek-v3", {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.7}}, "mscale 0.7 without mscale_all_dim"),
        ("deepseek-v3", {"rope_scaling": {"type": "linear", "factor": 2}}, "'linear' cannot be expressed with multi-latent attention"),
    ],
    ids=["sigmoid-unnormalised", "sigmoid-top1", "v3-group-score", "v2-group-score", "mla-bias", "mla-eps", "not-interleaved", "lone-mscale", "mla-linear-rope"],
)
def test_what_megatron_cannot_express_is_refused(model, changes, message):
    with pytest.raises(ConversionError, match=message):
        flags_of({**real_config(model), **changes})
