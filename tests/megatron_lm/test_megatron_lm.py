"""Megatron-LM itself checks what mconvert writes (Python 3.12 environment, megatron-core 0.19.2, which ships
`megatron.training`): its parser takes exactly the flags of megatron_args.sh and reads them as the model the
checkpoint stores; its own `load_checkpoint`, into the model its pretrain_gpt.py builds, loads the checkpoint
on CPU gloo ranks with transformers' logits; `--use-checkpoint-args` needs MODEL_ARGS beside it."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package: the Python 3.12 environment")

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.formats import dcp_writer  # noqa: E402
from mconvert.mcore.checkpoint import iteration_dir, read_args  # noqa: E402
from mconvert.mcore.parallelism import Parallelism, PipelineSplit  # noqa: E402
from mconvert.megatron_lm.args import FLAG_OF_ARG, MEGATRON_LM_DEFAULTS, RESTORED_BY_CHECKPOINT_ARGS  # noqa: E402
from mconvert.megatron_lm.flags import pipeline_split_flags  # noqa: E402
from mconvert.synthetic import write_word_tokenizer  # noqa: E402
from mconvert.verify.hf_side import load_hf_model  # noqa: E402
from mconvert.verify.distributed import ParallelLayout, run_ranks  # noqa: E402
from mconvert.verify.megatron_lm import (  # noqa: E402
    CPU_FLAGS,
    RUN_FLAGS,
    load_as_megatron_lm,
    parse_megatron_lm_args,
    script_arrays,
)
from mconvert.verify.megatron_side import forward_logits  # noqa: E402

MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 5, "num_key_value_heads": 2}
OLMO3 = {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "sliding_window": 5, "num_key_value_heads": 2}
GEMMA3 = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}
MODELS = {
    # name: (config, layers, overrides, parallelism)
    "llama3.1-tp2": ("llama-3.1-8b", 2, {}, Parallelism(tp=2)),
    "llama2-pp2": ("llama-2-7b", 4, {}, Parallelism(pp=2)),
    "mistral-window-tp2": ("llama-2-7b", 2, MISTRAL, Parallelism(tp=2)),
    "qwen2.5-tp2": ("qwen2.5-7b-instruct", 2, {}, Parallelism(tp=2)),
    "qwen3-pp2": ("qwen3-8b", 4, {}, Parallelism(pp=2)),
    "qwen3moe-ep2": ("qwen3-30b-a3b", 2, {}, Parallelism(ep=2)),
    "qwen3moe-dense-first-tp2ep2etp1": ("qwen3-30b-a3b", 2, {"mlp_only_layers": [0]}, Parallelism(tp=2, ep=2, etp=1)),
    "qwen2moe-ep2": ("qwen1.5-moe-a2.7b", 2, {}, Parallelism(ep=2)),
    "mixtral-tp2ep2": ("mixtral-8x7b-v0.1", 2, {}, Parallelism(tp=2, ep=2)),
    # Multi-latent attention, sigmoid routing with expert bias, group-limited routing, yarn; GLM-4.5's partial rope.
    "deepseek-v3-tp2ep2": ("deepseek-v3", 2, {}, Parallelism(tp=2, ep=2)),
    "glm4.5-air-pp2": ("glm-4.5-air", 2, {}, Parallelism(pp=2)),
    # Kimi-K2 as released: model_type kimi_k2 with its own code (auto_map) of DeepseekV3ForCausalLM; YaRN betas 1, 1.
    "kimi-k2-tp2ep2": ("kimi-k2-instruct", 2, {}, Parallelism(tp=2, ep=2)),
    # gpt-oss: sinks (softmax_type learnable), a window on every other layer, YaRN, biased router and experts,
    # clamped quick-GEGLU; biased experts need ETP 1.
    "gpt-oss-tp2ep2etp1": ("gpt-oss-20b", 2, {"sliding_window": 4}, Parallelism(tp=2, ep=2, etp=1)),
    # Gated delta-net beside gated full attention, zero-centred norms, partial rope; Qwen3-Next's experts with a
    # gated shared expert; Qwen3.5 as its image-text checkpoint.
    "qwen3-next-tp2ep2": ("qwen3-next-80b-a3b-instruct", 4, {}, Parallelism(tp=2, ep=2)),
    "qwen3.5-tp2pp2": ("qwen3.5-0.8b", 4, {}, Parallelism(tp=2, pp=2)),
    # Qwen3-VL's language model (Qwen3 under the image-text checkpoint's prefix; text positions make its multimodal rope
    # plain rope).
    "qwen3-vl-tp2pp2": ("qwen3-vl-8b-instruct", 4, {}, Parallelism(tp=2, pp=2)),
    # TP above the 2 query groups (megatron-core splits the fused QKV's rows evenly still; 4 linear key heads).
    "qwen3-next-tp4": ("qwen3-next-80b-a3b-instruct", 4, {"linear_num_key_heads": 4, "linear_num_value_heads": 8}, Parallelism(tp=4)),
    # DeepSeek Sparse Attention beside multi-latent attention: the indexer's halves rope (DeepSeek-V3.2), its
    # interleaved rope (GLM-5.1, at its own epsilons: rms_norm_eps 1e-5, the latent norms' and the indexer's key
    # norm's 1e-6); top-k 8 of the 12-token prompts.
    "deepseek-v3.2-tp2ep2": ("deepseek-v3.2", 2, {"index_topk": 8}, Parallelism(tp=2, ep=2)),
    "glm-5.1-tp2pp2": ("glm-5.1", 4, {"index_topk": 8}, Parallelism(tp=2, pp=2)),
    # For the logits within 1e-4: megatron-core has one epsilon for every norm, transformers keeps 1e-6 for the
    # latents', which moves GLM-5.1's logits by up to 1e-3 at its own (tests/megatron_lm/test_sparse_attention.py
    # measures it): here every norm's is the latents'.
    "glm-5.1-tp2pp2-latent-epsilon": ("glm-5.1", 4, {"index_topk": 8, "rms_norm_eps": 1e-6}, Parallelism(tp=2, pp=2)),
    # Multi-latent attention without a query bottleneck (q_lora_rank null), softmax routing.
    # q/k norms across heads, from mconvert's layer spec (--spec)
    "minimax-m2-tp2ep2": ("minimax-m2.7", 2, {}, Parallelism(tp=2, ep=2)),
    # Rope on interleaved pairs (--rotary-interleaved), tied embeddings, head_dim apart from the width.
    "ernie4.5-tp2pp2": ("ernie-4.5-0.3b-pt", 4, {}, Parallelism(tp=2, pp=2)),
    # q/k norms across heads (--spec) with softmax routing, the top-k not renormalised.
    "olmoe-tp2ep2": ("olmoe-1b-7b-0924", 2, {}, Parallelism(tp=2, ep=2)),
    # Norms after the attention and the MLP, none before them, q/k norms across heads: OLMo 2's layers, from mconvert's
    # layer spec (--spec); OLMo 3's with windows on three layers in four (the prompts 12 tokens), grouped-query.
    "olmo2-tp2": ("olmo-2-1124-7b-instruct", 2, {}, Parallelism(tp=2)),
    "olmo3-pp2": ("olmo-2-1124-7b-instruct", 4, OLMO3, Parallelism(pp=2)),
    # Norms before and after the attention and the MLP, a tanh-GELU GeGLU, the sliding-window layers' own rope theta:
    # Gemma 3's layers, from mconvert's layer spec (--spec); its embedding multiplier and attention scale through
    # MuP's flags; the image-text checkpoint's linear rope scaling on the global layers.
    "gemma3-text-tp2pp2": ("gemma-3-1b-pt", 4, GEMMA3, Parallelism(tp=2, pp=2)),
    "gemma3-vision-tp2": ("gemma-3-4b-it", 4, GEMMA3, Parallelism(tp=2)),
    "deepseek-v2-lite-ep2": ("deepseek-v2-lite", 2, {}, Parallelism(ep=2)),
    # Layer counts that no pipeline size divides: Megatron-LM's uneven splits (DeepSeek-V3 has 61 layers).
    "qwen3-pp2-first-stage-1": ("qwen3-8b", 3, {}, Parallelism(pp=2, pipeline=PipelineSplit(first_stage_layers=1))),
    "llama3.1-pp2-embedding-counts": ("llama-3.1-8b", 3, {}, Parallelism(pp=2, pipeline=PipelineSplit(embedding_counts=True))),
    "qwen2.5-pp2-layout": ("qwen2.5-7b-instruct", 3, {}, Parallelism(pp=2, pipeline=PipelineSplit(layout="Et|ttL"))),
    "qwen2.5-pp2-interleaved-layout": ("qwen2.5-7b-instruct", 3, {}, Parallelism(pp=2, pipeline=PipelineSplit(layout="E|t|(t|)*1,tL"))),
    # Nemotron 3 Super's latent MoE (--moe-latent-size) beside Mamba layers: a HybridModel checkpoint.
    "nemotron-3-super-tp2ep2": ("nemotron-3-super-120b-a12b", 4, {"hybrid_override_pattern": "ME*E"}, Parallelism(tp=2, ep=2, model_class="hybrid")),
    # DeepSeek-V3's experts beside other attention: GLM-4.7-Flash's MLA with its dense layer where mlp_layer_types says,
    # dots.llm1's q/k norms and an 8-token window from max_window_layers on, Hy3's own tensor names.
    "glm-4.7-flash-tp2ep2": ("glm-4.7-flash", 3, {"mlp_layer_types": ["sparse", "dense", "sparse"]}, Parallelism(tp=2, ep=2)),
    "dots1-window-tp2ep2": ("dots.llm1.inst", 2, {"sliding_window": 8, "max_window_layers": 1}, Parallelism(tp=2, ep=2)),
    "hy3-tp2ep2": ("hy3-preview", 2, {}, Parallelism(tp=2, ep=2)),
    # DeepSeek-V3's multi-token prediction layer in the layout (m), on the last stage.
    "deepseek-v3-mtp-pp2-layout": ("deepseek-v3", 3, {"mtp": True}, Parallelism(pp=2, ep=2, pipeline=PipelineSplit(layout="Et|ttmL"))),
}

TOKENS = torch.randint(0, 999, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def converted(hf_model_factory, tmp_path_factory):
    """convert(name) -> (HF dir with a tokenizer, converted checkpoint dir), once per model."""
    made = {}

    def convert(name: str) -> tuple[Path, Path]:
        if name not in made:
            config, layers, overrides, parallelism = MODELS[name]
            hf = hf_model_factory(config, layers=layers, **overrides)
            if not (hf / "tokenizer.json").exists():
                write_word_tokenizer(hf, 1000)
            ckpt = tmp_path_factory.mktemp(name) / "mcore"
            convert_hf_to_mcore(hf, ckpt, parallelism=parallelism)
            made[name] = hf, ckpt
        return made[name]

    return convert


def world_size(parallelism: Parallelism) -> int:
    return ParallelLayout(parallelism.tp, parallelism.pp, parallelism.ep, parallelism.etp).world_size


def test_restored_args_are_megatron_lms():
    from megatron.training.checkpointing import load_args_from_checkpoint

    calls = [node for node in ast.walk(ast.parse(inspect.getsource(load_args_from_checkpoint))) if isinstance(node, ast.Call)]
    restored = {call.args[0].value for call in calls if getattr(call.func, "id", None) == "_set_arg"}
    assert restored == RESTORED_BY_CHECKPOINT_ARGS


def test_defaults_and_flags_are_megatron_lms():
    """The defaults mconvert compares against, and the flag it names for each arg, are Megatron-LM's."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    defaults = parser.parse_args([])
    assert {name: getattr(defaults, name) for name in MEGATRON_LM_DEFAULTS} == MEGATRON_LM_DEFAULTS
    for name in MEGATRON_LM_DEFAULTS:
        flag = FLAG_OF_ARG.get(name, "--" + name.replace("_", "-"))
        assert parser._option_string_actions[flag].dest == name


@pytest.mark.parametrize("name", MODELS)
def test_megatron_lm_parses_the_printed_flags_as_the_stored_model(name, converted):
    hf, ckpt = converted(name)
    parsed = parse_megatron_lm_args(script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS, world_size(MODELS[name][3]))
    stored = read_args(iteration_dir(ckpt))
    for arg in [*MEGATRON_LM_DEFAULTS, "tokenizer_type", "tokenizer_model", "bf16", "fp16",
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "virtual_pipeline_model_parallel_size"]:
        if arg == "num_query_groups" and not stored.group_query_attention:
            continue  # multi-head attention: Megatron-LM ignores the number of groups
        # Dense models' args leave the MoE ones out: Megatron-LM's defaults.
        assert getattr(parsed, arg) == getattr(stored, arg, MEGATRON_LM_DEFAULTS.get(arg)), arg
    assert parsed.load == str(ckpt.absolute()) and parsed.finetune
    if PipelineSplit.from_args(stored) != PipelineSplit():
        # megatron-core's TransformerConfig checks the split against the model (a layout's layers, MTP included).
        from megatron.training.arguments import core_transformer_config_from_args

        argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
        config = core_transformer_config_from_args(parse_megatron_lm_args(argv, world_size(MODELS[name][3])))
        assert config.num_layers_in_first_pipeline_stage == stored.decoder_first_pipeline_num_layers
        layout = config.pipeline_model_parallel_layout
        assert (layout and layout.input_data) == stored.pipeline_model_parallel_layout
    assert (parsed.no_load_optim, parsed.no_load_rng, parsed.ckpt_format) == (True, True, "torch_dist")


# The Transformer Engine of the GPU machines that trained from converted checkpoints (docs/verification.md).
GPU_TRANSFORMER_ENGINE = "2.20.2"


def never_called(*args, **kwargs):
    raise AssertionError("a stand-in for a Transformer Engine kernel was called: only its presence is asked about")


def answer_as_transformer_engine_would(monkeypatch) -> None:
    """What megatron-core's TransformerConfig asks of Transformer Engine (its version; whether its fused rope and
    permutation kernels import) answered as on the GPU machines, so that on this CPU box its validation runs past
    those questions to its end instead of stopping at the first ("Please install TE")."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import moe_utils
    from packaging.version import Version

    def is_te_min_version(version, check_equality=True):
        return Version(GPU_TRANSFORMER_ENGINE) >= Version(version) if check_equality else Version(GPU_TRANSFORMER_ENGINE) > Version(version)

    monkeypatch.setattr(transformer_config, "is_te_min_version", is_te_min_version)
    monkeypatch.setattr(transformer_config, "get_te_version", lambda: Version(GPU_TRANSFORMER_ENGINE))
    for name in ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"):
        monkeypatch.setattr(rope_utils, name, never_called)
    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, never_called, raising=False)


@pytest.mark.parametrize("name", MODELS)
def test_the_printed_flags_alone_make_a_config_megatron_core_accepts(name, converted, monkeypatch):
    """MODEL_ARGS as printed (Transformer Engine, Megatron-LM's fused defaults), with no CPU flags: megatron-core's
    TransformerConfig runs every one of its validations and objects to none (it refused Megatron-LM's default rope
    fusion beside sparse attention, which a GPU training run found: --no-rope-fusion is printed). Its questions to
    Transformer Engine are answered as the GPU machines' would answer them."""
    from megatron.training.arguments import core_transformer_config_from_args

    _, ckpt = converted(name)
    argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS
    answer_as_transformer_engine_would(monkeypatch)
    core_transformer_config_from_args(parse_megatron_lm_args(argv, world_size(MODELS[name][3])))


def test_mla_yarn_settings_reach_megatron_lms_config_as_megatron_args_sh_says(converted):
    """Kimi-K2's YaRN betas have no Megatron-LM flag under multi-latent attention: the printed flags alone build
    MLATransformerConfig's defaults, and the assignments megatron_args.sh states, made on the parsed args before
    gpt_config_from_args (pretrain_gpt.py's path to its model builder), build the model's."""
    from megatron.training.argument_utils import gpt_config_from_args

    _, ckpt = converted("kimi-k2-tp2ep2")
    script = (ckpt / "megatron_args.sh").read_text()
    (line,) = [line for line in script.splitlines() if line.startswith("# Not settable by Megatron-LM's flags:")]
    assignments = re.findall(r"args\.(\w+) = ([0-9.e+-]+)", line)
    assert dict(assignments) == {"beta_fast": "1"}  # beta_slow 1 is MLATransformerConfig's default too
    argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    flags_alone = gpt_config_from_args(parse_megatron_lm_args(argv, 4)).transformer
    assert (flags_alone.beta_fast, flags_alone.beta_slow) == (32, 1)
    args = parse_megatron_lm_args(argv, 4)
    for name, value in assignments:
        setattr(args, name, float(value))
    config = gpt_config_from_args(args).transformer
    stored = read_args(iteration_dir(ckpt))
    assert (config.beta_fast, config.beta_slow, config.original_max_position_embeddings) == (1.0, 1.0, 4096)
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (stored.rotary_scaling_factor, stored.mscale, stored.mscale_all_dim)


@pytest.mark.parametrize("name", ["qwen3-next-tp2ep2", "qwen3.5-tp2pp2"])
def test_gated_delta_net_reaches_megatron_lms_model_builder(name, converted):
    """pretrain_gpt.py's path from the printed flags to its model: gpt_config_from_args gives the TransformerConfig
    of the stored args' gated delta-net layers, and Megatron-LM's GPT builder picks megatron-core's experimental
    block spec for it (which builds those layers under Transformer Engine only: on GPUs)."""
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models import gpt as gpt_builder

    _, ckpt = converted(name)
    argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    args = parse_megatron_lm_args(argv, world_size(MODELS[name][3]))
    config = gpt_config_from_args(args).transformer
    stored = read_args(iteration_dir(ckpt))
    fields = ("experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "attention_output_gate")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(stored, f) for f in fields}
    assert config.experimental_attention_variant == "gated_delta_net" and config.linear_attention_freq == 4
    assert config.layernorm_zero_centered_gamma and config.qk_layernorm and args.rotary_percent == 0.25
    source = inspect.getsource(gpt_builder)
    assert "get_transformer_block_with_experimental_attention_variant_spec(config=transformer_cfg" in source


@pytest.mark.parametrize("name", ["deepseek-v3.2-tp2ep2", "glm-5.1-tp2pp2"])
def test_sparse_attention_reaches_megatron_lms_model_builder(name, converted):
    """pretrain_gpt.py's path from the printed flags to its model: gpt_config_from_args gives the TransformerConfig
    of the stored args' indexer, with sequence parallelism (absorbed MLA needs it at TP > 1)."""
    from megatron.training.argument_utils import gpt_config_from_args

    _, ckpt = converted(name)
    argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    config = gpt_config_from_args(parse_megatron_lm_args(argv, world_size(MODELS[name][3]))).transformer
    stored = read_args(iteration_dir(ckpt))
    fields = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
              "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_k_norm_epsilon", "sequence_parallel")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(stored, f) for f in fields}
    assert config.experimental_attention_variant == "dsa" and config.sequence_parallel and not config.dsa_indexer_rotate_activation
    assert config.dsa_indexer_rope_interleaved == name.startswith("glm")
    # The model's own epsilons (GLM-5.1's differ), as transformers' norms and indexer use them; the indexer's key norm
    # takes the layers' where the args leave its own unset, as megatron-core's DSAIndexer does.
    hf_eps = json.loads((converted(name)[0] / "config.json").read_text())["rms_norm_eps"]
    key_norm_eps = config.layernorm_epsilon if config.dsa_indexer_k_norm_epsilon is None else config.dsa_indexer_k_norm_epsilon
    assert (config.layernorm_epsilon, key_norm_eps) == (hf_eps, 1e-6)


@pytest.mark.parametrize("name", ["qwen3-next-tp2ep2", "deepseek-v3.2-tp2ep2"])
def test_megatron_lm_builds_no_mtp_block_beside_an_attention_variant(name, converted):
    """Why hf-to-mcore leaves the multi-token prediction layers of Qwen3-Next, Qwen3.5, DeepSeek-V3.2 and GLM-5.1
    out (and says so): Megatron-LM 0.19.2's mtp_block_spec asks get_gpt_decoder_layer_specs for the decoder's last
    layer, which refuses gated delta-net and sparse attention alike."""
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models import gpt as gpt_builder

    _, ckpt = converted(name)
    argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS + ["--mtp-num-layers", "1"]
    config = gpt_config_from_args(parse_megatron_lm_args(argv, 4))
    with pytest.raises(AssertionError, match="Experimental attention variant is not supported"):
        gpt_builder.mtp_block_spec(config, transformer_layer_spec=None)


SPLITS = [
    PipelineSplit(), PipelineSplit(first_stage_layers=1), PipelineSplit(last_stage_layers=2),
    PipelineSplit(first_stage_layers=1, last_stage_layers=1), PipelineSplit(first_stage_layers=3), PipelineSplit(first_stage_layers=0),
    PipelineSplit(embedding_counts=True), PipelineSplit(loss_counts=True), PipelineSplit(embedding_counts=True, loss_counts=True),
    PipelineSplit(first_stage_layers=1, embedding_counts=True),
    PipelineSplit(layout="Et|ttL"), PipelineSplit(layout="Et|t|t|L"), PipelineSplit(layout="E|t|t|tL"), PipelineSplit(layout="Ett|tL"),
    PipelineSplit(layout="E(t|)*3,L"), PipelineSplit(layout="tE|ttL"), PipelineSplit(layout="Et|ttm|L"),
]


def test_the_pipeline_split_is_refused_exactly_where_megatron_lm_refuses_it(converted):
    """For layer counts, pipeline sizes and splits around the edges: mconvert's check passes exactly where
    Megatron-LM's parser and validation and megatron-core's TransformerConfig take the same flags and its stages
    then build every layer of the model. (Megatron takes --decoder-first/last-pipeline-num-layers at PP 1, where
    its one stage builds only the last stage's count: refused here.)"""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.training.arguments import core_transformer_config_from_args

    from mconvert.errors import ConversionError

    _, ckpt = converted("qwen3-pp2")
    model_args = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    disagreements = []
    for num_layers in (3, 4):
        for pp in (1, 2, 3, 4):
            for split in SPLITS:
                try:
                    split.check(pp, num_layers)
                    ours = True
                except ConversionError:
                    ours = False
                argv = model_args + ["--num-layers", str(num_layers), "--pipeline-model-parallel-size", str(pp)]
                argv += [word for flag in pipeline_split_flags(split) for word in flag.split(" ", 1)]
                argv = [word.strip("'") for word in argv]
                try:
                    config = core_transformer_config_from_args(parse_megatron_lm_args(argv, pp))
                    theirs = split.layout is not None or sum(
                        get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)
                    ) == num_layers
                except (AssertionError, ValueError):
                    theirs = False
                if ours != theirs:
                    disagreements.append((num_layers, pp, split, ours, theirs))
    assert not disagreements, "\n".join(map(str, disagreements))


def megatron_lm_logits(argv: list[str], tokens: torch.Tensor) -> torch.Tensor:
    """In each rank: Megatron-LM parses, builds and loads; rank 0 returns the logits."""
    model, _ = load_as_megatron_lm(argv)
    return forward_logits(model, tokens)


def hf_logits(hf: Path) -> torch.Tensor:
    """transformers' logits as mconvert verify builds the reference (an image-text model without a causal-LM class,
    Qwen3-VL's, as its image-text class on text)."""
    model = load_hf_model(hf, torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def run_megatron_lm(name: str, argv: list[str]) -> torch.Tensor:
    parallelism = MODELS[name][3]
    return run_ranks(
        megatron_lm_logits, argv, TOKENS,
        tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, etp=parallelism.etp, timeout_s=600,
    )


# Not Gemma 3's 4B and larger (gemma3-vision-tp2): pretrain_gpt.py builds GPTModel without their linear rope scaling
# (--rotary-seq-len-interpolation-factor; megatron_args.sh says to pass it, mconvert.megatron_lm.flags.pretrain_gpt_caveats);
# megatron-core's logits with it: tests/megatron_lm/test_gemma3.py.
# Not DeepSeek on CPU: Megatron-LM 0.19.2's local (non-TE) MLA passes its core attention arguments that
# DotProductAttention does not take; megatron-core's check (tests/test_deepseek_megatron.py) shims that.
@pytest.mark.parametrize(
    "name", ["llama3.1-tp2", "mistral-window-tp2", "gpt-oss-tp2ep2etp1", "qwen3-pp2", "qwen2moe-ep2", "qwen3moe-dense-first-tp2ep2etp1", "glm4.5-air-pp2",
             "qwen3-pp2-first-stage-1", "llama3.1-pp2-embedding-counts", "qwen2.5-pp2-layout", "qwen3-next-tp2ep2", "qwen3.5-tp2pp2", "qwen3-vl-tp2pp2",
             "qwen3-next-tp4", "deepseek-v3.2-tp2ep2", "glm-5.1-tp2pp2-latent-epsilon", "minimax-m2-tp2ep2", "ernie4.5-tp2pp2",
             "olmoe-tp2ep2", "dots1-window-tp2ep2", "hy3-tp2ep2", "olmo2-tp2", "olmo3-pp2", "gemma3-text-tp2pp2"]
)
def test_megatron_lm_load_checkpoint_gives_transformers_logits(name, converted):
    hf, ckpt = converted(name)
    logits = run_megatron_lm(name, script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS)
    torch.testing.assert_close(logits[..., :1000], hf_logits(hf), rtol=1e-4, atol=1e-4)


def test_megatron_lm_loads_a_checkpoint_whose_writers_went_on_into_new_data_files(converted, tmp_path, monkeypatch):
    """Each writing thread goes on into a new data file every DATA_FILE_BYTES (2 GB; 200 kB here, so that a small
    model spans many): Megatron-LM's load_checkpoint finds every chunk across them."""
    hf, _ = converted("llama3.1-tp2")
    monkeypatch.setattr(dcp_writer, "DATA_FILE_BYTES", 200_000)
    ckpt = tmp_path / "mcore"
    convert_hf_to_mcore(hf, ckpt, parallelism=MODELS["llama3.1-tp2"][3], workers=2)
    assert len(list(iteration_dir(ckpt).glob("*.distcp"))) > 4
    logits = run_megatron_lm("llama3.1-tp2", script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS)
    torch.testing.assert_close(logits[..., :1000], hf_logits(hf), rtol=1e-4, atol=1e-4)


def test_use_checkpoint_args_needs_model_args_beside_it(converted):
    """Qwen3's q/k norms and norm epsilon are not among what --use-checkpoint-args restores: alone it builds
    another model (the one the user was warned of), with MODEL_ARGS the right one."""
    hf, ckpt = converted("qwen3-pp2")
    reference = hf_logits(hf)
    restored = ["--use-checkpoint-args", *script_arrays(ckpt, "LOAD_ARGS"), "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", str(hf.absolute())]
    with_model_args = run_megatron_lm("qwen3-pp2", script_arrays(ckpt, "MODEL_ARGS") + restored + RUN_FLAGS + CPU_FLAGS)
    torch.testing.assert_close(with_model_args[..., :1000], reference, rtol=1e-4, atol=1e-4)
    alone = run_megatron_lm("qwen3-pp2", restored + ["--pipeline-model-parallel-size", "2"] + RUN_FLAGS + CPU_FLAGS)
    assert (alone[..., :1000] - reference).abs().max() > 1e-2
    assert "does not restore --norm-epsilon, --qk-layernorm" in (ckpt / "megatron_args.sh").read_text()


def megatron_lm_save(argv: list[str], iteration: int) -> None:
    """In each rank: Megatron-LM loads the checkpoint and saves it as training does (its save_checkpoint)."""
    from megatron.training.checkpointing import save_checkpoint

    model, _ = load_as_megatron_lm(argv)
    save_checkpoint(iteration, model, None, None, 0)


@pytest.mark.parametrize("name", ["qwen2.5-tp2", "qwen2moe-ep2", "qwen3-pp2-first-stage-1", "qwen3-next-tp2ep2", "glm-5.1-tp2pp2", "minimax-m2-tp2ep2", "olmo2-tp2", "gemma3-text-tp2pp2"])
def test_a_megatron_lm_training_save_exports_bit_identically(name, converted, tmp_path):
    """Megatron-LM's own save (iteration directory, common state in the DCP files, args with its enums and
    0.19 names; with its layers split unevenly over the pipeline stages) of the loaded checkpoint exports to
    exactly the HF weights it came from."""
    from safetensors.torch import load_file

    hf, ckpt = converted(name)
    parallelism = MODELS[name][3]
    save = ["--save", str(tmp_path / "run"), "--save-interval", "1", "--no-save-optim", "--no-save-rng"]
    run_ranks(
        megatron_lm_save, script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS + save, 7,
        tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, etp=parallelism.etp, timeout_s=600,
    )
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "hf")],
        check=True, capture_output=True,
    )
    original = {k: v for path in hf.glob("*.safetensors") for k, v in load_file(path).items()}
    exported = {k: v for path in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(path).items()}
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rms_norm_eps"] == json.loads((hf / "config.json").read_text())["rms_norm_eps"]


def test_megatron_core_019_cannot_build_mla_without_q_lora_rank_and_says_so(converted):
    """megatron-core 0.19 fuses a layer norm into linear_q_proj when q_lora_rank is null (DeepSeek-V2-Lite has
    none: on GPUs, under Transformer Engine, its strict load asks for `linear_q_proj.layer_norm_weight`);
    megatron_args.sh warns, and verify refuses in one line rather than comparing another model."""
    hf, ckpt = converted("deepseek-v2-lite-ep2")
    assert "# Caveat: megatron-core 0.19 and later add a layer norm before linear_q_proj" in (ckpt / "megatron_args.sh").read_text()
    run = subprocess.run(
        [sys.executable, "-m", "mconvert", "verify", "--hf", str(hf), "--mcore", str(ckpt), "--ep", "2", "--device", "cpu"],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "mconvert verify: error: megatron-core 0.19.2 cannot build this checkpoint's model: for multi-latent attention "
        "without q_lora_rank it adds a layer norm before linear_q_proj"
    )


def test_megatron_core_has_no_softmax_router_with_an_expert_bias():
    """What refusing ERNIE 4.5 MoE stands on (mconvert.mappings.INEXPRESSIBLE): megatron-core 0.19.2's TransformerConfig
    refuses an expert bias beside softmax scores, and its softmax routing, before or after the top-k, reads none (a
    bias that would choose other experts changes nothing), where ERNIE's router chooses by softmax + bias."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    with pytest.raises(ValueError, match="[Ee]xpert bias"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                          moe_router_enable_expert_bias=True, moe_router_score_function="softmax")
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(8)
    bias[logits[0].argmax()] = -10.0  # the first token's best expert would not be chosen
    for pre_softmax in (True, False):
        plain = topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax, score_function="softmax")
        biased = topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax, score_function="softmax",
                                                  expert_bias=bias)
        assert all(torch.equal(a, b) for a, b in zip(plain, biased))
    chosen = torch.topk(torch.softmax(logits, dim=-1) + bias, 2).indices  # ERNIE's choice
    assert not torch.equal(chosen.sort(dim=1).values, torch.topk(logits, 2).indices.sort(dim=1).values)
