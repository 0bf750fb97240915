"""Checkpoints that ship their own model code (config.json's `auto_map`, transformers' trust_remote_code) under a
model_type of their own: read as the class their `architectures` name when mconvert maps it, never by running
their code. Kimi-K2 as released is DeepseekV3ForCausalLM under `model_type: kimi_k2`, with a YaRN beta_fast of 1
(MLATransformerConfig's default is 32) that Megatron-LM's command line cannot set under multi-latent attention:
it converts, its stored args hold it, megatron_args.sh says how to set it, and megatron-core built with it gives
transformers' logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli

# Importing either file of the checkpoint's own code leaves this file behind it.
MARKER_CODE = "from pathlib import Path\nPath(__file__).with_name('CODE_WAS_RUN').write_text(__name__)\n"


def with_config(hf: Path, out: Path, **changes) -> Path:
    """`hf`'s files linked into `out`, its config.json with `changes`."""
    out.mkdir()
    for file in hf.iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file)
    (out / "config.json").write_text(json.dumps(json.loads((hf / "config.json").read_text()) | changes))
    return out


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    """A Kimi-K2 as released, shrunk: its config.json (kimi_k2, auto_map, YaRN betas 1 and 1), random weights
    at a scale whose attention is not near uniform, and its own code placed beside them."""
    config = shrink(real_config("kimi-k2-instruct"), layers=2)
    hf = make_hf_checkpoint(config, tmp_path_factory.mktemp("kimi") / "hf")
    assert json.loads((hf / "config.json").read_text())["model_type"] == "kimi_k2"
    for module in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (hf / module).write_text(MARKER_CODE)
    return hf


def test_kimi_k2_converts_as_deepseek_v3_both_ways_without_its_code(kimi, tmp_path):
    out = run_cli("hf-to-mcore", "--load-dir", kimi, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2")
    assert out.returncode == 0, out.stderr
    assert "model_type 'kimi_k2' ships its own code (auto_map), which was not run: read as DeepseekV3ForCausalLM" in out.stdout
    args = read_args(iteration_dir(tmp_path / "mcore"))
    assert (args.beta_fast, args.beta_slow, args.original_max_position_embeddings) == (1.0, 1.0, 4096)
    assert (args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == (32.0, 1.0, 1.0)
    # DeepSeek-V3's routing (sigmoid scores, expert bias), not V2's: the class decides, not the model_type.
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    script = (tmp_path / "mcore" / "megatron_args.sh").read_text()
    # beta_slow 1 is MLATransformerConfig's default too: only beta_fast needs setting.
    assert "# Not settable by Megatron-LM's flags: YaRN's beta_fast=1: " in script
    assert "MLATransformerConfig(beta_fast=1)" in script and "set args.beta_fast = 1 in pretrain_gpt.py" in script

    back = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back", "--hf-config", kimi)
    assert back.returncode == 0, back.stderr
    original, written = (json.loads((d / "config.json").read_text()) for d in (kimi, tmp_path / "back"))
    for field in ("model_type", "architectures", "auto_map"):
        assert written[field] == original[field], field
    assert {k: written["rope_scaling"][k] for k in ("beta_fast", "beta_slow", "factor")} == {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0}
    before, after = load_file(kimi / "model.safetensors"), {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        after.update(load_file(path))
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    assert not (kimi / "CODE_WAS_RUN").exists()


def test_megatron_core_with_kimis_yarn_gives_transformers_logits_and_the_default_betas_do_not(kimi, tmp_path):
    """`mconvert verify` builds megatron-core's model from the stored args, betas included, and transformers'
    DeepseekV3ForCausalLM from the Kimi config: they agree. The same checkpoint with MLATransformerConfig's
    default betas (what Megatron-LM's flags alone build) does not: the betas are not a detail."""
    assert run_cli("hf-to-mcore", "--load-dir", kimi, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2").returncode == 0
    verify = ("verify", "--hf", kimi, "--mcore", tmp_path / "mcore", "--device", "cpu", "--tp", "2", "--ep", "2")
    passed = run_cli(*verify)
    assert passed.returncode == 0 and passed.stdout.strip().endswith("PASS"), passed.stdout + passed.stderr

    common = iteration_dir(tmp_path / "mcore") / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].beta_fast, state["args"].beta_slow = 32.0, 1.0
    torch.save(state, common)
    failed = run_cli(*verify)
    assert failed.returncode == 1 and "FAIL" in failed.stdout + failed.stderr, failed.stdout + failed.stderr
    assert not (kimi / "CODE_WAS_RUN").exists()


def test_kimi_k2_split_over_two_pipeline_stages_gives_transformers_logits(kimi, tmp_path):
    """Its dense first layer on one stage, its MoE layer on the other."""
    assert run_cli("hf-to-mcore", "--load-dir", kimi, "--save-dir", tmp_path / "mcore", "--pp", "2").returncode == 0
    passed = run_cli("verify", "--hf", kimi, "--mcore", tmp_path / "mcore", "--device", "cpu", "--pp", "2")
    assert passed.returncode == 0 and passed.stdout.strip().endswith("PASS"), passed.stdout + passed.stderr


def test_an_auto_map_into_a_class_mconvert_does_not_map_is_refused_naming_it(kimi, tmp_path):
    hf = with_config(kimi, tmp_path / "hf", architectures=["KimiLinearForCausalLM"], model_type="kimi_linear",
                     auto_map={"AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"})
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, "config.json", "kimi_linear", "auto_map: modeling_kimi.KimiLinearForCausalLM")
    assert_nothing_left(tmp_path / "out")
    assert not (kimi / "CODE_WAS_RUN").exists()


def test_a_class_the_code_does_not_define_is_not_taken_from_architectures(kimi, tmp_path):
    """Read as a known class only when the shipped code is that class: a config whose auto_map names other code
    than its architectures' class is refused, not converted as the class it merely lists."""
    auto_map = json.loads((kimi / "config.json").read_text())["auto_map"]
    hf = with_config(kimi, tmp_path / "hf", auto_map={**auto_map, "AutoModelForCausalLM": "modeling_deepseek.DeepseekV4ForCausalLM"})
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, "config.json", "kimi_k2", "auto_map: modeling_deepseek.DeepseekV4ForCausalLM")
