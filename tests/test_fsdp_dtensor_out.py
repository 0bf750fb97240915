"""`hf-to-mcore --format fsdp_dtensor`: what a Megatron-FSDP run (`--use-megatron-fsdp`) starts from. Checked here
against a real Megatron-FSDP save (tests/fixtures/fsdp/fsdp_dtensor-deepseek, made by Megatron-LM 0.19.2 on a
GPU: every name and shape it holds must be written) and by mcore-to-hf (bit for bit); on the GPU by Megatron-LM's own
training steps from it (docs/verification.md, stage `fsdp-in` of scripts/gpu/gpu_session.sh)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from cli_runner import assert_nothing_left, assert_one_line_error, run_cli

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.inspection import inspect_megatron
from mconvert.mcore.checkpoint import TRACKER_FILE
from mconvert.mcore.parallelism import Parallelism, padded_vocab_size
from mconvert.synthetic import add_mtp_layers, make_hf_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "fsdp" / "fsdp_dtensor-deepseek"
# id: (real config, overrides, mconvert flags)
CASES = {
    "llama-tp2": ("llama-3.1-8b", {}, ["--tp", "2"]),
    "qwen2.5-tied": ("qwen2.5-7b-instruct", {"tie_word_embeddings": True}, []),
    "qwen3-moe-ep2": ("qwen3-30b-a3b", {}, ["--ep", "2"]),
    # Multi-latent attention, a dense then an MoE layer with a shared expert and the routing bias, an MTP layer.
    "deepseek-v3-mtp": ("deepseek-v3", {"mtp": True}, []),
}


def convert(hf, out, *flags):
    done = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, "--format", "fsdp_dtensor", "--quiet", *flags)
    assert done.returncode == 0, done.stderr
    return DCPCheckpoint(out / "iter_0000000")


@pytest.mark.parametrize("case", CASES)
def test_fsdp_dtensor_round_trip_is_bit_exact(case, hf_model_factory, tmp_path):
    config, overrides, flags = CASES[case]
    hf = hf_model_factory(config, **overrides)
    out, back = tmp_path / "fsdp", tmp_path / "back"
    stored = convert(hf, out, *flags)
    # Iteration 0 of a run, not a release: Megatron-FSDP starts from it only as a resumption (flags below).
    assert (out / TRACKER_FILE).read_text() == "0"
    # What tells Megatron-LM an FSDP save from torch_dist: a DCP folder without metadata.json.
    assert not (out / "iter_0000000" / "metadata.json").exists() and not (out / "iter_0000000" / "common.pt").exists()
    assert stored.read_object("args").ckpt_format == "fsdp_dtensor" and stored.read_object("iteration") == 0
    steps = [key for key in stored.object_keys if key.startswith("optimizer.")]
    assert steps and all(re.fullmatch(r"optimizer\.param_to_group_meta\.(module\.){2,3}.+\.step", k) for k in steps)
    assert all(stored.read_object(key) == 0 for key in steps)
    # SwiGLU fc1 in halves only, never whole.
    assert [k for k in stored.shapes if re.search(r"\.linear_fc1\.weight\d*_w$", k)]
    assert not [k for k in stored.shapes if re.search(r"\.linear_fc1\.weight\d*$", k)]
    done = run_cli("mcore-to-hf", "--load-dir", out, "--save-dir", back, "--hf-config", hf, "--quiet")
    assert done.returncode == 0, done.stderr
    original, exported = HFCheckpoint(hf), HFCheckpoint(back)
    assert sorted(original.tensors) == sorted(exported.tensors)
    for name in original.tensors:
        assert np.array_equal(original.read(name).view(np.uint8), exported.read(name).view(np.uint8)), name
    shown = run_cli("inspect", out)
    assert shown.returncode == 0 and "fsdp_dtensor checkpoint" in shown.stdout, shown.stdout + shown.stderr


def test_every_name_a_megatron_fsdp_save_holds_is_written(tmp_path):
    """A Megatron-FSDP run loads by its own names and skips those it does not find (its load is partial: the
    flags below): each name and shape of a real save of the same architecture (DeepSeek-V3 with MTP, Transformer
    Engine's spec, grouped experts), and each parameter's step count, must be in the conversion."""
    config = json.loads((FIXTURE / "config.json").read_text())
    hf = add_mtp_layers(make_hf_checkpoint(config, tmp_path / "hf", seed=0))
    ours = convert(hf, tmp_path / "fsdp", "--dtype", "bf16")
    real = DCPCheckpoint(FIXTURE / "save" / "iter_0000002")
    weights = {key: shape for key, shape in real.shapes.items() if key.startswith("model.")}
    assert len(weights) == 95
    assert {key: ours.shapes.get(key) for key in weights} == weights
    steps = {key for key in real.object_keys if key.startswith("optimizer.param_to_group_meta.") and key.endswith(".step")}
    assert len(steps) == 74 and steps <= set(ours.object_keys)


def test_the_vocabulary_is_padded_as_the_runs_tp_pads_it(hf_model_factory, tmp_path):
    hf = hf_model_factory("qwen2.5-7b-instruct")
    stored = convert(hf, tmp_path / "fsdp", "--tp", "4", "--make-vocab-size-divisible-by", "100")
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    rows = stored.shapes["model.module.embedding.word_embeddings.weight"][0]
    assert rows == padded_vocab_size(vocab, Parallelism(tp=4, make_vocab_size_divisible_by=100)) and rows % 400 == 0
    # Whole tensors: inspect offers each TP that pads the vocabulary to these rows, and one pipeline stage.
    suits = inspect_megatron(tmp_path / "fsdp")["suits"]
    assert 4 in suits["tp"] and suits["pp"] == [1]


def test_the_flags_start_a_megatron_fsdp_run(hf_model_factory, tmp_path):
    out = tmp_path / "fsdp"
    convert(hf_model_factory("llama-3.1-8b"), out, "--tp", "2")
    script = (out / "megatron_args.sh").read_text()
    load = script[script.index("LOAD_ARGS=(") :].split()
    # A resumption (not --finetune nor --no-load-optim, which stop a Megatron-FSDP run in Megatron-LM 0.19.2), its
    # load partial: the checkpoint holds no optimizer moments or scheduler state (mconvert.megatron_lm.flags).
    assert load[1:] == ["--load", str(out.absolute()), "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                        "--no-strict-fsdp-dtensor-load", "--no-load-rng", ")"]
    assert "--tensor-model-parallel-size 2" in script and "HYBRID_ARGS" not in script
    train = (out / "train.sh").read_text()
    assert ('LOAD_ARGS=(--load "$CHECKPOINT_DIR" --use-megatron-fsdp --ckpt-format fsdp_dtensor '
            "--no-strict-fsdp-dtensor-load --no-load-rng)") in train


def test_pipeline_stages_are_refused_for_fsdp_dtensor(hf_model_factory, tmp_path):
    out = tmp_path / "fsdp"
    done = run_cli("hf-to-mcore", "--load-dir", hf_model_factory("llama-3.1-8b"), "--save-dir", out, "--format", "fsdp_dtensor", "--pp", "2")
    assert_one_line_error(done, "--format fsdp_dtensor", "--pp 2")
    assert_nothing_left(out)


@pytest.mark.parametrize("config, flags, tensor", [
    ("qwen3-next-80b-a3b-instruct", [], "self_attention.conv1d.weight.query"),
    ("nemotron-3-nano-30b-a3b", ["--model-class", "hybrid"], "in_proj.weight.z"),
])
def test_sectioned_tensors_are_refused_for_fsdp_dtensor(config, flags, tensor, hf_model_factory, tmp_path):
    """Gated delta-net's and Mamba's in_proj: megatron-core keys their sections apart, Megatron-FSDP stores the fused
    parameter, whose rows follow the run's TP; its partial load would skip the sections' names without a word."""
    out, overrides = tmp_path / "fsdp", {"hybrid_override_pattern": "M*-E"} if config.startswith("nemotron") else {}
    hf = hf_model_factory(config, layers=4, **overrides)
    done = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, "--format", "fsdp_dtensor", *flags)
    assert_one_line_error(done, "--format fsdp_dtensor", tensor, "Megatron-FSDP stores fused")
    assert_nothing_left(out)


def test_the_api_writes_it_without_torch_dists_files(hf_model_factory, tmp_path):
    result = convert_hf_to_mcore(hf_model_factory("qwen3-30b-a3b"), tmp_path / "fsdp", ckpt_format="fsdp_dtensor")
    assert result.args.ckpt_format == "fsdp_dtensor"
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == [
        "iter_0000000", TRACKER_FILE, "mconvert.sha256", "megatron_args.sh", "train.sbatch", "train.sh"]
