"""DeepSeek-V3.2 and GLM-5.1 (multi-latent attention with DeepSeek Sparse Attention's lightning indexer) converted to
torch_dist and checked by megatron-core 0.19.2's own GPTModel on gloo CPU ranks: TP 2 with EP 2, TP 2 with PP 2.
megatron-core builds the `dsa` variant only under Transformer Engine; on CPU ranks its own absorbed MLA,
DSAttention and DSAIndexer run with local linears (mconvert.verify.cpu_shims.sparse_attention_block_without_te).
The prompts are 160 tokens and the indexer keeps 32 of them, so it chooses; weights at std 0.1. Injected faults (the
indexer's weights zeroed, its rope layout flipped, its top-k as long as the prompts) each move megatron-core's logits
away from transformers'; the conversion back is bit-exact."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="megatron-core 0.19's sparse attention: the Python 3.12 environment")

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from mconvert import mappings  # noqa: E402
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf  # noqa: E402
from mconvert.errors import ConversionError  # noqa: E402
from mconvert.mappings import (
    deepseek_v32,  # noqa: E402
    get_mapping,  # noqa: E402
)
from mconvert.mappings.transforms import Rename  # noqa: E402
from mconvert.mcore.checkpoint import iteration_dir  # noqa: E402
from mconvert.mcore.parallelism import Parallelism  # noqa: E402
from mconvert.megatron_lm.args import megatron_args  # noqa: E402
from mconvert.megatron_lm.flags import megatron_flags  # noqa: E402
from mconvert.synthetic import add_mtp_layers, real_config  # noqa: E402
from mconvert.verify.distributed import run_ranks  # noqa: E402
from tests.cli_runner import run_cli  # noqa: E402
from tests.test_moe_megatron import megatron_view, stored_keys  # noqa: E402

TOKENS = torch.randint(0, 1000, (2, 160), generator=torch.Generator().manual_seed(0))
# name: (config, layout, config overrides). GLM-5.1's rms_norm_eps (1e-5) set to its latent norms' (1e-6): megatron-core
# has one epsilon for every norm, and at GLM-5.1's own the logits move by up to 1e-3, which would hide a fault of
# that size here; test_glm_51s_norm_epsilons_differ_from_megatrons_and_the_conversion_says_so holds its own.
CASES = {
    "deepseek-v3.2-tp2ep2": ("deepseek-v3.2", Parallelism(tp=2, ep=2), {}),
    "glm-5.1-tp2pp2": ("glm-5.1", Parallelism(tp=2, pp=2), {"rms_norm_eps": 1e-6}),
    # Layers 2 and 4 reuse the top-k of layers 1 and 3 (GLM's shared indexer layers; no indexer weights there).
    "glm-5.1-shared-top-k-tp2": ("glm-5.1", Parallelism(tp=2), {"rms_norm_eps": 1e-6, "index_topk_freq": 2, "index_skip_topk_offset": 1}),
}


@pytest.fixture(scope="module")
def made(hf_model_factory):
    """(config name, overrides) -> its random-init HF checkpoint (4 layers: a dense one, then experts), at std 0.1."""
    return lambda name, **overrides: hf_model_factory(name, layers=4, weight_std=0.1, **overrides)


def hf_logits(hf_dir) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def megatron(ckpt, parallelism: Parallelism):
    """megatron-core's logits (real vocabulary), and whether it loaded every key it asked for from what is stored."""
    views = run_ranks(megatron_view, {"model": str(ckpt)}, TOKENS, tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, timeout_s=600)
    logits, _, asked = views["model"]
    return logits[..., :1000], asked <= stored_keys(ckpt)


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for path in directory.glob("*.safetensors") for k, v in load_file(path).items()}


def report(what: str, megatron_logits: torch.Tensor, reference: torch.Tensor) -> None:
    """The figures docs/verification.md quotes (`pytest -s` shows them): the largest difference at each position."""
    per_position = (megatron_logits - reference).abs().amax(-1).flatten().sort(descending=True).values
    print(f"\n{what}: largest per-position differences {[f'{d:.2g}' for d in per_position[:3].tolist()]}, "
          f"positions over 1e-4: {int((per_position > 1e-4).sum())} of {per_position.numel()}")


def positions_off(megatron_logits: torch.Tensor, reference: torch.Tensor, by: float = 1e-4) -> float:
    """The fraction of positions whose logits differ by more than `by` (1e-4: more than fp32's other summation
    orders give).
    The indexer's top-k is a discrete choice: where two tokens' scores are within rounding of each other at the
    k-th place, the two sides may keep different ones, and that position differs by far more."""
    return ((megatron_logits - reference).abs().amax(-1) > by).double().mean().item()


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_gives_transformers_logits_and_the_export_is_bit_exact(case, made, tmp_path):
    name, parallelism, overrides = CASES[case]
    hf = made(name, **overrides)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    logits, strict = megatron(tmp_path / "mcore", parallelism)
    assert strict
    # At most 1 of the 320 positions may keep another token at the top-k's edge (seen: 1 at TP 2 with EP 2).
    report(case, logits, hf_logits(hf))
    assert positions_off(logits, hf_logits(hf)) <= 1 / 320
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    original, back = (hf_tensors(d) for d in (hf, tmp_path / "back"))
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", hf))
    fields = ("model_type", "architectures", "index_n_heads", "index_head_dim", "index_topk", "q_lora_rank", "kv_lora_rank")
    assert {f: written[f] for f in fields} == {f: read[f] for f in fields}


def test_the_prompts_make_the_indexer_choose(made, tmp_path):
    """The 160-token prompts are longer than the indexer's top-k (32): keeping every token instead changes
    transformers' logits, and a checkpoint whose stored args keep every token moves megatron-core's away from them."""
    hf = made("deepseek-v3.2")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        chosen = model(TOKENS).logits
        model.config.index_topk = 160
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 160
        every_token = model(TOKENS).logits
    assert (chosen - every_token).abs().amax(-1).gt(1e-2).double().mean() > 0.5
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    common = iteration_dir(tmp_path / "mcore") / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].dsa_indexer_topk = 160
    torch.save(state, common)
    logits, _ = megatron(tmp_path / "mcore", Parallelism(tp=2))
    report("deepseek-v3.2, every token kept", logits, chosen)
    assert positions_off(logits, chosen) > 0.5


def flip_indexer_rope(ckpt):
    """The args as if the indexer's rope rotated the other layout (interleaved pairs for halves)."""
    common = iteration_dir(ckpt) / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].dsa_indexer_rope_interleaved = not state["args"].dsa_indexer_rope_interleaved
    torch.save(state, common)


class Zeroed(Rename):
    """A conversion that loses the tensor: zeros in its place."""

    def to_mcore_parts(self, tensors, spec):
        return [np.zeros_like(tensors[0])]


@pytest.mark.parametrize("fault", ["indexer weights zeroed", "indexer rope layout flipped"])
@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5.1"])
def test_an_injected_fault_moves_megatrons_logits(fault, name, made, tmp_path, monkeypatch):
    if fault == "indexer weights zeroed":
        indexer = tuple(Zeroed(entry.mcore, entry.hf, split=entry.split) if entry.mcore.endswith("linear_wq_b.weight") else entry for entry in deepseek_v32.INDEXER)
        table = dataclasses.replace(deepseek_v32.TABLE, indexer=indexer)
        monkeypatch.setitem(mappings.FAMILIES, "deepseek_v32", dataclasses.replace(deepseek_v32.FAMILY, table=table))
    hf = made(name, rms_norm_eps=1e-6)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    if fault == "indexer rope layout flipped":
        flip_indexer_rope(tmp_path / "mcore")
    logits, _ = megatron(tmp_path / "mcore", Parallelism(tp=2))
    report(f"{name}, {fault}", logits, hf_logits(hf))
    assert positions_off(logits, hf_logits(hf)) > 0.2


def test_glm_51s_norm_epsilons_differ_from_megatrons_and_the_conversion_says_so(made, tmp_path):
    """GLM-5.1's rms_norm_eps is 1e-5 but transformers normalises MLA's latents with 1e-6; megatron-core has one
    epsilon for all norms. Measured with every token kept (no top-k edge to cross): the logits move by more than
    fp32's summation orders but by less than 1e-3; with the top-k choosing, a rare near-tie flips."""
    hf = made("glm-5.1")
    out = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert "note: transformers normalises the attention latents with epsilon 1e-06 and the rest with rms_norm_eps 1e-05" in out.stdout
    assert "--dsa-indexer-k-norm-epsilon 1e-06" in out.stdout  # the indexer's key norm keeps its own
    assert "--norm-epsilon 1e-05" in out.stdout
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rms_norm_eps"] == 1e-5
    every_token = made("glm-5.1", index_topk=160)
    convert_hf_to_mcore(every_token, tmp_path / "every", parallelism=Parallelism(tp=2))
    logits, _ = megatron(tmp_path / "every", Parallelism(tp=2))
    moved = (logits - hf_logits(every_token)).abs().max().item()
    report("glm-5.1 at its own epsilons, every token kept", logits, hf_logits(every_token))
    assert 2e-5 < moved < 1e-3
    logits, _ = megatron(tmp_path / "mcore", Parallelism(tp=2))
    report("glm-5.1 at its own epsilons, top-k 32", logits, hf_logits(hf))
    assert positions_off(logits, hf_logits(hf), by=1e-3) <= 0.02


def test_the_summary_prints_the_dsa_flags_and_leaves_the_mtp_layer_out_saying_why(made, tmp_path):
    """DeepSeek-V3.2 as the hub holds it, with its multi-token prediction layer (layer 4 here, 61 there):
    Megatron-LM 0.19.2 builds none beside the attention variant (tests/megatron_lm/test_megatron_lm.py), so it is
    left out and said so; the flags turn off the indexer's Hadamard rotation (orthogonal: no score changes, as
    transformers leaves it out) and turn on sequence parallelism, which the absorbed MLA needs at TP > 1."""
    hf = tmp_path / "hf"
    made_dir = made("deepseek-v3.2")
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        (hf / name).write_bytes((made_dir / name).read_bytes())
    add_mtp_layers(hf)
    out = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2")
    assert out.returncode == 0, out.stderr
    assert f"left out 1 multi-token prediction layer(s) of {hf} ({deepseek_v32.MTP_LEFT_OUT})" in out.stdout
    for flag in ("--experimental-attention-variant dsa", "--dsa-indexer-n-heads 8", "--dsa-indexer-head-dim 24",
                 "--dsa-indexer-topk 32", "--no-dsa-indexer-rotate-activation", "--sequence-parallel", "--multi-latent-attention"):
        assert flag in out.stdout, flag
    assert "--mtp-num-layers" not in out.stdout and "--dsa-indexer-rope-interleaved" not in out.stdout


def test_glm_51s_shared_top_k_schedule_is_megatron_cores():
    """GLM-MoE-DSA layers that reuse the previous indexer's top-k ('shared'): transformers' schedule from
    index_topk_freq and index_skip_topk_offset is megatron-core's dsa_indexer_topk_freq and skip offset; a
    pattern no such pair gives is refused."""
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer

    config = {**real_config("glm-5.1"), "num_hidden_layers": 8, "index_topk_freq": 3, "index_skip_topk_offset": 2}
    spec = get_mapping(config)[1]
    assert spec.sparse_attention.indexer_layers == (True, True, False, False, True, False, False, True)
    flags = megatron_flags(megatron_args(spec, Parallelism(), torch.bfloat16, "transformer_engine"))
    assert "--dsa-indexer-topk-freq 3" in flags and "--dsa-indexer-skip-topk-offset 2" in flags
    assert [not is_dsa_skip_topk_layer(n, 2, 3) for n in range(1, 9)] == list(spec.sparse_attention.indexer_layers)
    with pytest.raises(ConversionError, match="indexer_types"):
        get_mapping({**config, "indexer_types": ["full", "shared", "full", "full", "shared", "shared", "full", "shared"]})



def test_mconvert_verify_gives_its_indexer_a_prompt_longer_than_the_top_k_and_catches_a_flipped_rope(made, tmp_path):
    """`mconvert verify` on CPU ranks (TP 2 with EP 2; sequence parallelism pads the prompts to even halves): its
    built-in prompts (up to 64 tokens) are within a top-k of 64, so it adds one of 128 tokens; the indexer's rope
    layout flipped in the stored args fails it."""
    hf = made("deepseek-v3.2", index_topk=64)
    ckpt = tmp_path / "mcore"
    assert run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", ckpt, "--tp", "2", "--ep", "2").returncode == 0
    layout = ("--tp", "2", "--ep", "2", "--device", "cpu")
    out = run_cli("verify", "--hf", hf, "--mcore", ckpt, *layout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "prompt 4 (128 tokens) makes its indexer choose" in out.stdout and "PASS" in out.stdout
    flip_indexer_rope(ckpt)
    out = run_cli("verify", "--hf", hf, "--mcore", ckpt, *layout)
    assert out.returncode != 0 and "FAIL" in out.stdout
