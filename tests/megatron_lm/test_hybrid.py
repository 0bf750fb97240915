"""Megatron-LM checks mconvert's HybridModel checkpoints (`hf-to-mcore --model-class hybrid`; Python 3.12,
megatron-core 0.19.2): its parser reads the printed flags as the stored model; pretrain_hybrid.py's config and
builder (hybrid_config_from_args, HybridModelBuilder) with the local stack spec CPU ranks need
(mconvert.verify.hybrid_model) and its own `load_checkpoint`, strict, give transformers' logits; its own
save_checkpoint of that HybridModel exports to the HF weights bit for bit. And a GPT checkpoint loads into a
HybridModel run by Megatron-LM's own translation with the HYBRID_ARGS megatron_args.sh prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package: the Python 3.12 environment")

from safetensors.torch import load_file  # noqa: E402

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.mcore import hybrid  # noqa: E402
from mconvert.mcore.checkpoint import iteration_dir, read_args  # noqa: E402
from mconvert.mcore.parallelism import Parallelism, PipelineSplit  # noqa: E402
from mconvert.megatron_lm.args import MEGATRON_LM_DEFAULTS  # noqa: E402
from mconvert.megatron_lm.hybrid_args import hybrid_shared_top_k  # noqa: E402
from mconvert.synthetic import write_word_tokenizer  # noqa: E402
from mconvert.verify.distributed import ParallelLayout, RankFailed, run_ranks  # noqa: E402
from mconvert.verify.megatron_lm import (  # noqa: E402
    CPU_FLAGS,
    RUN_FLAGS,
    load_as_megatron_lm,
    parse_megatron_lm_args,
    script_arrays,
)
from mconvert.verify.megatron_side import forward_logits  # noqa: E402
from tests.megatron_lm.test_megatron_lm import TOKENS, hf_logits  # noqa: E402

HYBRID = dict(model_class="hybrid")
MODELS = {
    # name: (config, layers, overrides, parallelism, pattern)
    "llama2-tp2": ("llama-2-7b", 2, {}, Parallelism(tp=2, **HYBRID), "*-*-"),
    # MLA beside a dense first layer and MoE, its MTP layer, three layers over two stages.
    "deepseek-v3-mtp-tp2pp2": ("deepseek-v3", 3, {"mtp": True},
                               Parallelism(tp=2, pp=2, pipeline=PipelineSplit(first_stage_layers=1), **HYBRID), "+-|+E+E/+E"),
    # Gated delta-net beside gated full attention, zero-centred norms; the MTP layer GPTModel cannot build beside them.
    "qwen3-next-tp2ep2": ("qwen3-next-80b-a3b-instruct", 4, {"mtp": True}, Parallelism(tp=2, ep=2, **HYBRID), "GEGEGE*E/*E"),
    # Sparse attention with its MTP layer, which GPTModel cannot build beside it (the GPT conversion leaves it out).
    "deepseek-v3.2-tp2ep2": ("deepseek-v3.2", 2, {"index_topk": 8, "mtp": True}, Parallelism(tp=2, ep=2, **HYBRID), "D-DE/DE"),
    # A window on every other layer: its schedule spread over the pattern.
    "gpt-oss-ep2": ("gpt-oss-20b", 2, {"sliding_window": 4}, Parallelism(ep=2, etp=1, **HYBRID), "*E*E"),
    # q/k norms across heads: mconvert's HybridModel stack spec (--spec mconvert.megatron_lm.hybrid_layer_specs ...).
    "minimax-m2-tp2ep2": ("minimax-m2.7", 2, {}, Parallelism(tp=2, ep=2, **HYBRID), "*E*E"),
    # Norms after the attention and the MLP: OLMo 2's halves in mconvert's stack spec.
    "olmo2-tp2": ("olmo-2-1124-7b-instruct", 2, {}, Parallelism(tp=2, **HYBRID), "*-*-"),
}


@pytest.fixture(scope="module")
def converted(hf_model_factory, tmp_path_factory):
    made = {}

    def convert(name: str) -> tuple[Path, Path]:
        if name not in made:
            config, layers, overrides, parallelism, _ = MODELS[name]
            # Matrices at std 0.1: attention far from uniform over the prompt.
            hf = hf_model_factory(config, layers=layers, weight_std=0.1, **overrides)
            if not (hf / "tokenizer.json").exists():
                write_word_tokenizer(hf, 1000)
            ckpt = tmp_path_factory.mktemp(name) / "mcore"
            convert_hf_to_mcore(hf, ckpt, parallelism=parallelism)
            made[name] = hf, ckpt
        return made[name]

    return convert


def world(parallelism: Parallelism) -> int:
    return ParallelLayout(parallelism.tp, parallelism.pp, parallelism.ep, parallelism.etp).world_size


@pytest.mark.parametrize("name", MODELS)
def test_megatron_lm_parses_the_printed_flags_as_the_stored_hybrid_model(name, converted):
    _, ckpt = converted(name)
    parallelism = MODELS[name][3]
    parsed = parse_megatron_lm_args(script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS, world(parallelism))
    stored = read_args(iteration_dir(ckpt))
    assert stored.hybrid_layer_pattern == MODELS[name][4]
    for arg in ("hybrid_layer_pattern", "num_layers", "mtp_num_layers", "moe_layer_freq", "window_attn_skip_freq",
                "linear_attention_freq", "experimental_attention_variant", "multi_latent_attention",
                "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "spec"):
        # Args a model's args leave out: Megatron-LM's defaults.
        assert getattr(parsed, arg) == getattr(stored, arg, {**MEGATRON_LM_DEFAULTS, "multi_latent_attention": False}.get(arg)), arg
    assert parsed.num_layers == len(hybrid.split_pattern(stored.hybrid_layer_pattern)[0])


def load_and_save(argv: list[str], save: str) -> torch.Tensor:
    """In each rank: Megatron-LM parses, builds as pretrain_hybrid.py does, loads; saves as training does;
    rank 0 returns the logits."""
    from megatron.training.checkpointing import save_checkpoint

    model, _ = load_as_megatron_lm(argv + ["--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng"])
    save_checkpoint(3, model, None, None, 0)
    return forward_logits(model, TOKENS)


@pytest.mark.parametrize("name", ["deepseek-v3-mtp-tp2pp2", "qwen3-next-tp2ep2", "deepseek-v3.2-tp2ep2", "gpt-oss-ep2", "minimax-m2-tp2ep2", "olmo2-tp2"])
def test_megatron_lm_loads_the_hybrid_checkpoint_and_its_save_exports_bit_identically(name, converted, tmp_path):
    hf, ckpt = converted(name)
    parallelism = MODELS[name][3]
    logits = run_ranks(
        load_and_save, script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS, str(tmp_path / "run"),
        tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, etp=parallelism.etp, timeout_s=600,
    )
    torch.testing.assert_close(logits[..., :1000], hf_logits(hf), rtol=1e-4, atol=1e-4)
    # Megatron-LM's own HybridModel save, back to HF.
    subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "hf")],
        check=True, capture_output=True,
    )
    original = {k: v for path in hf.glob("*.safetensors") for k, v in load_file(path).items()}
    exported = {k: v for path in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(path).items()}
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def logits_of(argv: list[str]) -> torch.Tensor:
    model, _ = load_as_megatron_lm(argv)
    return forward_logits(model, TOKENS)


def test_a_gpt_checkpoint_loads_into_a_hybrid_run_with_hybrid_args(hf_model_factory, tmp_path):
    """Megatron-LM's load translates a GPT checkpoint (stacked layers) into a HybridModel itself, given the pattern and
    stack spec of HYBRID_ARGS: transformers' logits. A model whose MLPs mix dense and MoE gets no HYBRID_ARGS."""
    hf = hf_model_factory("qwen3-30b-a3b", layers=2, weight_std=0.1)
    write_word_tokenizer(hf, 1000)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(ep=2))
    argv = script_arrays(tmp_path / "mcore", "MODEL_ARGS", "HYBRID_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    assert "*E*E" in argv
    torch.testing.assert_close(run_ranks(logits_of, argv, ep=2, timeout_s=600)[..., :1000], hf_logits(hf), rtol=1e-4, atol=1e-4)
    mixed = hf_model_factory("qwen3-30b-a3b", layers=2, weight_std=0.1, mlp_only_layers=[0])
    convert_hf_to_mcore(mixed, tmp_path / "mixed", parallelism=Parallelism())
    assert "HYBRID_ARGS" not in (tmp_path / "mixed" / "megatron_args.sh").read_text()


def test_megatron_lm_refuses_a_hybrid_checkpoint_with_its_sub_blocks_swapped(converted, tmp_path, monkeypatch):
    """The injected fault: each GPT layer's MLP written before its attention. Megatron-LM's strict load says so."""
    hf, _ = converted("llama2-tp2")
    monkeypatch.setattr(hybrid, "sub_block", lambda name: 1 if name.startswith(hybrid.ATTENTION_SCOPES) else 0)
    convert_hf_to_mcore(hf, tmp_path / "swapped", parallelism=Parallelism(**HYBRID))
    argv = script_arrays(tmp_path / "swapped", "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    with pytest.raises(RankFailed, match="decoder.layers.1.self_attention.linear_qkv.weight"):
        run_ranks(logits_of, argv, timeout_s=600)


def test_thehybrid_shared_top_k_schedule_keeps_megatron_cores_layers():
    """Sparse attention's top-k shared over layers (GLM-5.1): over HybridModel's numbers, the translated schedule
    picks the same layers to compute and share from as megatron-core's rule picks over GPT's."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        is_dsa_skip_topk_layer,
        source_dsa_compute_layer,
    )

    for freq, offset in [(2, 1), (3, 1), (2, 3), (4, 2)]:
        translated = hybrid_shared_top_k(freq, offset)
        hybrid_freq, hybrid_offset = translated["dsa_indexer_topk_freq"], translated["dsa_indexer_skip_topk_offset"]
        for layer in range(1, 20):
            at = 2 * layer - 1  # GPT layer n's attention is hybrid layer 2n - 1
            assert is_dsa_skip_topk_layer(at, hybrid_offset, hybrid_freq) == is_dsa_skip_topk_layer(layer, offset, freq)
            assert source_dsa_compute_layer(at, hybrid_offset, hybrid_freq) == 2 * source_dsa_compute_layer(layer, offset, freq) - 1


def test_verify_checks_a_hybrid_checkpoint_at_another_layout(converted, tmp_path):
    """`mconvert verify` builds megatron-core's HybridModel from the checkpoint's args alone: written at TP 2 x EP 2 and
    run at EP 2 (the sparse-attention indexer without sequence parallelism, its 64-token prompt past the top-k 8), it
    passes; against an HF model with GPT layer 1's MLP changed, it fails there (the hybrid MLP layer 3 ends it)."""
    from safetensors.torch import save_file

    from mconvert.verify.run import VerifyRequest, verify

    hf, ckpt = converted("deepseek-v3.2-tp2ep2")
    report = verify(VerifyRequest(hf, ckpt, Parallelism(ep=2)))
    assert report.passed and report.first_diverging_layer is None, report
    changed = tmp_path / "hf"
    changed.mkdir()
    for path in hf.iterdir():
        (changed / path.name).symlink_to(path)
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.1.mlp.shared_experts.down_proj.weight"] *= 1.5
    (changed / "model.safetensors").unlink()
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    report = verify(VerifyRequest(changed, ckpt, Parallelism(ep=2)))
    assert not report.passed and report.first_diverging_layer == 1
