"""ERNIE 4.5 dense converted to torch_dist and checked by megatron-core 0.16.1 (its GPTModel, local spec, gloo CPU
ranks) at TP 2 x PP 2 through `mconvert verify`: rope on interleaved pairs of each head's dims (megatron-core's
rotary_interleaved), tied embeddings, head_dim 128 beside a width of 1024 (shrunk: 32 beside 64). The injected fault,
the same checkpoint with rope on the halves of each head (the flag left out), moves megatron-core's logits far beyond
the tolerance. HybridModel builds its rope without the flag: refused in one line. ERNIE 4.5 MoE, whose router megatron-core
lacks, is refused in one line naming what it lacks (tests/megatron_lm/test_megatron_lm.py holds megatron-core to it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from mconvert import mappings
from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.mappings import ernie4_5, get_mapping
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from tests.test_parallel import hf_tensors
from tests.test_dense_megatron import TOKENS, megatron_view


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """ERNIE-4.5-0.3B's config.json shrunk to 4 layers (auto_map kept), weights at std 0.1."""
    config = shrink(real_config("ernie-4.5-0.3b-pt"), layers=4)
    return make_hf_checkpoint(config, tmp_path_factory.mktemp("ernie") / "hf", weight_std=0.1)


def test_verify_passes_at_tp2_pp2_and_the_export_is_bit_exact(hf, tmp_path, capsys):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(mcore), "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "read as transformers' built-in Ernie4_5ForCausalLM" in out and f"note: {ernie4_5.FP32_ROPE}" in out
    script = (mcore / "megatron_args.sh").read_text()
    assert "--rotary-interleaved" in script and "--kv-channels 32" in script and "--untie-embeddings" not in script
    assert main(["verify", "--hf", str(hf), "--mcore", str(mcore), "--device", "cpu", "--tp", "2", "--pp", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")
    # The export from the stored args alone.
    assert main(["mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    original, exported = hf_tensors(hf), hf_tensors(back)
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (back, hf))
    for field in ("model_type", "head_dim", "use_bias", "tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"):
        assert written[field] == read[field], field
    assert transformers.AutoConfig.from_pretrained(back).rope_parameters["rope_theta"] == 500000


def test_rope_on_the_halves_moves_megatrons_logits(hf, tmp_path, monkeypatch):
    halves = dataclasses.replace(ernie4_5.FAMILY, read_config=lambda config, source="config.json": dataclasses.replace(
        ernie4_5.read_config(config, source), rotary_interleaved=False))
    monkeypatch.setitem(mappings.FAMILIES, "ernie4_5", halves)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism())
    assert not read_args(iteration_dir(tmp_path / "mcore")).rotary_interleaved
    logits = run_ranks(megatron_view, str(tmp_path / "mcore"), TOKENS)[0][..., :1000]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (logits - model(TOKENS).logits).abs().max() > 1e-2


def test_the_config_rules(hf):
    """transformers' Ernie4_5Config defaults where config.json is silent (not Llama's); use_bias on every linear layer."""
    config = json.loads((hf / "config.json").read_text())
    defaulted = ("tie_word_embeddings", "num_key_value_heads", "head_dim", "rms_norm_eps")
    silent = {k: v for k, v in config.items() if k not in defaulted}
    spec = get_mapping(silent)[1]
    assert (spec.untie_embeddings, spec.num_query_groups, spec.head_dim, spec.norm_eps) == (False, 2, 128, 1e-5)
    assert get_mapping({**config, "head_dim": None})[1].head_dim == 16  # null: the width over the heads
    biased = get_mapping({**config, "use_bias": True})[1]
    assert biased.qkv_bias and biased.linear_bias
    assert mappings.write_hf_config(ernie4_5.FAMILY, biased)["use_bias"] is True
    assert mappings.family_for_spec(spec) is ernie4_5.FAMILY


def test_a_hybrid_model_is_refused_in_one_line(hf, tmp_path):
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out", "--model-class", "hybrid")
    assert_one_line_error(result, "--model-class hybrid", "rotary_interleaved", "--model-class gpt")
    assert_nothing_left(tmp_path / "out")


def test_ernie_4_5_moe_is_refused_in_one_line_naming_what_megatron_core_lacks(tmp_path):
    """Its config as transformers writes it, with the hub's own code named (auto_map), as the releases ship it."""
    hf = tmp_path / "hf"
    transformers.Ernie4_5_MoeConfig(architectures=["Ernie4_5_MoeForCausalLM"]).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    auto_map = {"AutoModelForCausalLM": "modeling_ernie4_5_moe.Ernie4_5_MoeForCausalLM"}
    (hf / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, "config.json", "'ernie4_5_moe' cannot be converted", "softmax", "expert bias",
                          "megatron-core 0.19.2 lacks")
    assert_nothing_left(tmp_path / "out")
