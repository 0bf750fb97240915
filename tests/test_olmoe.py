"""OLMoE converted to torch_dist and checked by megatron-core 0.16.1 (its GPTModel, local spec, gloo CPU ranks) at
TP 2 x EP 2 through `mconvert verify`: q and k each RMS-normalised over all heads of the layer (mconvert's layer spec,
split across TP ranks with the heads), experts in every layer routed by a softmax over all of them without
renormalising the top-k (norm_topk_prob false). Injected faults are caught: norm_topk_prob misread (the top-k
renormalised) moves megatron-core's logits; q/k norms per head would move transformers' own logits far beyond the
comparison's tolerance. What megatron-core cannot build (clip_qkv, a window, a head_dim of its own) is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from mconvert import mappings
from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping, olmoe
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from tests.test_parallel import hf_tensors
from tests.test_minimax_m2 import TOKENS, per_head
from tests.test_moe_megatron import megatron_view


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """OLMoE-1B-7B's shape (transformers' OlmoeConfig defaults) shrunk to 2 layers of 8 experts, top-2, weights at std
    0.1."""
    config = shrink(real_config("olmoe-1b-7b-0924"), layers=2)
    return make_hf_checkpoint(config, tmp_path_factory.mktemp("olmoe") / "hf", weight_std=0.1)


def hf_model(hf_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_verify_passes_at_tp2_ep2_and_the_export_is_bit_exact(hf, tmp_path, capsys):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(mcore), "--tp", "2", "--ep", "2"]) == 0
    script = (mcore / "megatron_args.sh").read_text()
    assert "--spec mconvert.megatron_lm.layer_specs gpt_layers_with_qk_norm_across_heads" in script
    assert "--moe-router-pre-softmax" in script and "--moe-ffn-hidden-size 128" in script
    assert "--moe-router-score-function" not in script and "--moe-shared-expert-intermediate-size" not in script
    capsys.readouterr()
    assert main(["verify", "--hf", str(hf), "--mcore", str(mcore), "--device", "cpu", "--tp", "2", "--ep", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")
    # The export from the stored args alone.
    assert main(["mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    original, exported = hf_tensors(hf), hf_tensors(back)
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (back, hf))
    for field in ("model_type", "num_experts", "num_experts_per_tok", "norm_topk_prob", "intermediate_size", "rms_norm_eps"):
        assert written[field] == read[field], field


def test_a_misread_norm_topk_prob_moves_megatrons_logits(hf, tmp_path, monkeypatch):
    """Read as renormalising the top-k (megatron-core's top-k of the logits, then a softmax over them)."""
    def renormalised(config, source="config.json"):
        spec = olmoe.read_config(config, source)
        return dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, router_pre_softmax=False))

    monkeypatch.setitem(mappings.FAMILIES, "olmoe", dataclasses.replace(olmoe.FAMILY, read_config=renormalised))
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism())
    logits = run_ranks(megatron_view, {"model": str(tmp_path / "mcore")}, TOKENS)["model"][0][..., :1000]
    with torch.no_grad():
        assert (logits - hf_model(hf)(TOKENS).logits).abs().max() > 1e-2


def test_q_k_norms_per_head_move_transformers_logits_far_beyond_the_tolerance(hf):
    model = hf_model(hf)
    with torch.no_grad():
        reference = model(TOKENS).logits
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.forward = lambda x, norm=norm: per_head(x, norm.weight, norm.variance_epsilon, 4)
        assert (model(TOKENS).logits - reference).abs().max() > 1e-2


@pytest.mark.parametrize(
    "change, named",
    [({"clip_qkv": 8.0}, "clip_qkv"), ({"sliding_window": 16}, "sliding_window"), ({"head_dim": 32}, "head_dim 32")],
)
def test_what_megatron_core_cannot_build_is_refused(hf, change, named):
    config = json.loads((hf / "config.json").read_text())
    with pytest.raises(ConversionError, match=named):
        get_mapping({**config, **change})


def test_clip_qkv_is_one_line(hf, tmp_path):
    broken = tmp_path / "hf"
    broken.mkdir()
    for file in hf.iterdir():
        if file.name != "config.json":
            (broken / file.name).symlink_to(file)
    (broken / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), "clip_qkv": 8.0}))
    result = run_cli("hf-to-mcore", "--load-dir", broken, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, "config.json", "clip_qkv 8.0", "megatron-core has no clamp")
    assert_nothing_left(tmp_path / "out")


def test_the_spec_read_back_from_args_is_olmoes(hf):
    spec = get_mapping(json.loads((hf / "config.json").read_text()))[1]
    assert mappings.family_for_spec(spec) is olmoe.FAMILY
    assert mappings.family_for_spec(get_mapping(shrink(real_config("minimax-m2.7")))[1]).name == "minimax_m2"
