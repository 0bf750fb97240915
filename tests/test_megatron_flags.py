"""The Megatron-LM flags mconvert prints: values in the form Megatron-LM's parser takes, everything the model
needs, the same text on the console and in megatron_args.sh, and which args `--use-checkpoint-args` would miss.
(Megatron-LM's own parser checks the flags in tests/megatron_lm/, in the Python 3.12 environment.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_dense_megatron import MISTRAL

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.megatron_lm.flags import (
    args_script,
    megatron_flags,
    not_restored_by_checkpoint_args,
    pretrain_gpt_caveats,
)
from mconvert.synthetic import real_config, shrink


def flags_of(config: dict, **parallel) -> list[str]:
    _, spec = get_mapping(config)
    return megatron_flags(megatron_args(spec, Parallelism(**parallel), torch.bfloat16, "transformer_engine"))


def test_rope_theta_is_printed_as_the_integer_megatron_lm_parses():
    assert "--rotary-base 1000000" in flags_of(shrink(real_config("qwen2.5-7b-instruct")))
    assert "--rotary-base 500000" in flags_of(shrink(real_config("llama-3.1-8b")))
    with pytest.raises(ConversionError, match=r"rope_theta 10000.5: Megatron-LM's --rotary-base takes only integers"):
        flags_of(shrink(real_config("llama-2-7b"), rope_theta=10000.5))


def test_flags_carry_dropout_dtype_and_sequence_length():
    flags = flags_of(shrink(real_config("qwen3-8b")))
    for flag in ("--attention-dropout 0", "--hidden-dropout 0", "--bf16", "--seq-length 4096", "--qk-layernorm"):
        assert flag in flags


def test_tokenizer_flags_name_the_hf_directory_when_it_has_a_tokenizer(hf_model_factory, tmp_path):
    hf = hf_model_factory("qwen2.5-7b-instruct")
    with_tokenizer = tmp_path / "hf"
    with_tokenizer.mkdir()
    for path in hf.iterdir():
        (with_tokenizer / path.name).symlink_to(path)
    (with_tokenizer / "tokenizer.json").write_text("{}")
    flags = convert_hf_to_mcore(with_tokenizer, tmp_path / "with").flags
    assert "--tokenizer-type HuggingFaceTokenizer" in flags
    assert f"--tokenizer-model {with_tokenizer.absolute()}" in flags
    assert not any(flag.startswith("--tokenizer") for flag in convert_hf_to_mcore(hf, tmp_path / "without").flags)


@pytest.mark.parametrize(
    "config_name, overrides, missed",
    [
        ("llama-2-7b", {}, []),
        ("qwen2.5-7b-instruct", {}, ["--norm-epsilon"]),
        ("qwen3-8b", {}, ["--norm-epsilon", "--qk-layernorm"]),
        ("llama-3.1-8b", {}, ["--use-rope-scaling"]),
        ("llama-2-7b", MISTRAL, ["--window-size"]),
        ("qwen1.5-moe-a2.7b", {}, ["--norm-epsilon", "--moe-shared-expert-gate", "--moe-aux-loss-coeff"]),
    ],
)
def test_args_that_use_checkpoint_args_misses_are_named(config_name, overrides, missed):
    _, spec = get_mapping(shrink(real_config(config_name), **overrides))
    args = megatron_args(spec, Parallelism(), torch.bfloat16, "transformer_engine")
    assert not_restored_by_checkpoint_args(args) == missed


def test_an_uneven_pipeline_split_is_in_the_flags_and_the_verify_command(hf_model_factory, tmp_path):
    """3 layers over 2 stages: the split's flag goes into MODEL_ARGS and into the printed verify command, which
    passes as printed (on CPU); the export does not depend on the split."""
    hf = hf_model_factory("qwen3-8b", layers=3)
    out = tmp_path / "mcore"
    done = subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(out),
         "--pp", "2", "--decoder-first-pipeline-num-layers", "1"],
        capture_output=True, text=True, check=True,
    )
    listed = subprocess.run(
        ["bash", "-c", f'source {out}/megatron_args.sh && printf "%s\n" "${{MODEL_ARGS[@]}}"'], capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert listed[listed.index("--decoder-first-pipeline-num-layers") + 1] == "1"
    assert "does not restore --norm-epsilon, --qk-layernorm, --decoder-first-pipeline-num-layers" in (out / "megatron_args.sh").read_text()
    (verify,) = [line for line in done.stdout.splitlines() if line.strip().startswith("mconvert verify")]
    command = verify.split("#")[0].split()
    assert command[command.index("--decoder-first-pipeline-num-layers") + 1] == "1"
    command[command.index("--device") + 1] = "cpu"
    checked = subprocess.run([sys.executable, "-m", "mconvert.cli", *command[1:]], capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.strip().endswith("PASS"), checked.stdout + checked.stderr[-2000:]
    shown = subprocess.run([sys.executable, "-m", "mconvert.cli", "inspect", str(out)], capture_output=True, text=True, check=True)
    assert "written for: TP=1 PP=2 EP=1 ETP=1 --decoder-first-pipeline-num-layers 1" in shown.stdout
    back = convert_mcore_to_hf(out, tmp_path / "back")
    assert back.config["num_hidden_layers"] == 3


def test_console_prints_exactly_megatron_args_sh(hf_model_factory, tmp_path):
    hf = hf_model_factory("qwen3-8b")
    out = tmp_path / "mcore"
    done = subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(out), "--tp", "2"],
        capture_output=True, text=True, check=True,
    )
    script = (out / "megatron_args.sh").read_text()
    assert script in done.stdout
    assert "does not restore --norm-epsilon, --qk-layernorm from a checkpoint" in script
    listed = subprocess.run(
        ["bash", "-c", f'source {out}/megatron_args.sh && printf "%s\\n" "${{MODEL_ARGS[@]}}" "${{LOAD_ARGS[@]}}"'],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert listed[listed.index("--rotary-base") + 1] == "1000000"
    assert listed[-7:] == ["--load", str(out.absolute()), "--ckpt-format", "torch_dist", "--finetune", "--no-load-optim", "--no-load-rng"]
    assert "--tensor-model-parallel-size" in listed and listed[listed.index("--tensor-model-parallel-size") + 1] == "2"


def test_sliding_window_becomes_megatron_window_size_and_comes_back(hf_model_factory, tmp_path):
    hf = hf_model_factory("llama-2-7b", **MISTRAL)
    conversion = convert_hf_to_mcore(hf, tmp_path / "mcore")
    assert conversion.args.window_size == (4, 0)
    assert "--window-size 4,0" in conversion.flags
    back = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert back.plan.family.name == "llama" and config["model_type"] == "mistral" and config["sliding_window"] == 5


@pytest.mark.parametrize(
    "overrides, window",
    [
        ({"use_sliding_window": False, "sliding_window": 4096}, None),  # Qwen2.5's hub config
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
        ({"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention"] * 2}, None),
    ],
)
def test_qwen_sliding_window_applies_as_transformers_applies_it(overrides, window):
    assert get_mapping(shrink(real_config("qwen2.5-7b-instruct"), **overrides))[1].sliding_window == window


def test_a_window_on_some_layers_only_is_an_error():
    config = shrink(real_config("qwen2.5-7b-instruct"), use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ConversionError, match=r"sliding-window attention on some layers only \(1 of 2\)"):
        get_mapping(config)


def test_llama_ignores_a_sliding_window_as_transformers_does():
    assert get_mapping(shrink(real_config("llama-2-7b"), sliding_window=8))[1].sliding_window is None


@pytest.mark.parametrize(
    "rope_scaling, caveat",
    [
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, None),
        ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "so with factor 8, not 32"),
        ({"rope_type": "linear", "factor": 4.0}, "without --rotary-seq-len-interpolation-factor"),
    ],
)
def test_rope_scaling_that_pretrain_gpt_drops_is_said(rope_scaling, caveat):
    _, spec = get_mapping(shrink(real_config("llama-3.1-8b"), rope_scaling=rope_scaling))
    args = megatron_args(spec, Parallelism(), torch.bfloat16, "transformer_engine")
    caveats = pretrain_gpt_caveats(args)
    script = args_script(args, Path("ckpt"))
    if caveat is None:
        assert caveats == [] and "Caveat" not in script
    else:
        assert len(caveats) == 1 and caveat in caveats[0] and f"# Caveat: {caveats[0]}." in script
