"""Gemma 3 converted to torch_dist and checked by megatron-core 0.19.2's own GPTModel on gloo CPU ranks (local spec,
mconvert's Gemma 3 layer spec as Megatron-LM's `--spec` loads it): the text model (gemma-3-1b-pt's config) at TP 2
x PP 2 and the language model of an image-text checkpoint (gemma-3-4b-it's: linear rope scaling x8 on the global
layers) at TP 2, each 4 layers, three of them attending within a window of 4 tokens, prompts three windows long,
weights at std 0.1. Its embedding multiplier and attention scale are megatron-core's MuP settings, which 0.16.1
lacks (tests/test_gemma3.py holds its one-line refusal). Injected faults move megatron-core's logits away from
transformers': the sliding-window layers rotated with the global layers' theta, the embeddings unscaled, and the
attention scaled by the heads' width instead of query_pre_attn_scalar."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="megatron-core 0.19's MuP settings: the Python 3.12 environment")

import transformers  # noqa: E402

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.mcore.checkpoint import iteration_dir, read_args  # noqa: E402
from mconvert.mcore.parallelism import Parallelism  # noqa: E402
from mconvert.verify.distributed import run_ranks  # noqa: E402
from tests.cli_runner import run_cli  # noqa: E402
from tests.test_gemma3 import MODELS, TOKENS, made  # noqa: E402,F401 (made: the fixture)
from tests.test_gpt_oss import stored_args_changed  # noqa: E402
from tests.test_moe_megatron import megatron_view  # noqa: E402


def hf_logits(hf_dir) -> torch.Tensor:
    with torch.no_grad():  # the image-text checkpoint's class, Gemma3ForConditionalGeneration, for gemma3
        return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(input_ids=TOKENS).logits


def megatron_logits(ckpt, parallelism: Parallelism, view=megatron_view) -> torch.Tensor:
    views = run_ranks(view, {"model": str(ckpt)}, TOKENS, tp=parallelism.tp, pp=parallelism.pp, timeout_s=600)
    return views["model"][0][..., :1000]


@pytest.fixture(scope="module")
def converted(made, tmp_path_factory):
    """name -> (its HF checkpoint, transformers' logits, the torch_dist checkpoint at its layout)."""
    done = {}

    def convert(name):
        if name not in done:
            hf, out = made(name), tmp_path_factory.mktemp(name) / "mcore"
            convert_hf_to_mcore(hf, out, parallelism=MODELS[name][3])
            done[name] = hf, hf_logits(hf), out
        return done[name]

    return convert


@pytest.mark.parametrize("name", MODELS)
def test_megatron_core_gives_transformers_logits(name, converted):
    _, reference, ckpt = converted(name)
    torch.testing.assert_close(megatron_logits(ckpt, MODELS[name][3]), reference, rtol=1e-4, atol=1e-4)


def megatron_view_with_the_global_theta_on_sliding_window_layers(ckpt_dirs: dict[str, str], tokens: torch.Tensor):
    """In each rank: megatron_view with mconvert's layer spec rotating the sliding-window layers as the others."""
    from mconvert.megatron_lm import layer_specs

    layer_specs.GEMMA3_SLIDING_WINDOW_ROPE_THETA = float(read_args(iteration_dir(Path(ckpt_dirs["model"]))).rotary_base)
    return megatron_view(ckpt_dirs, tokens)


# Stored args changed: each arg's right value, and the wrong one.
STORED_ARGS_FAULTS = {
    "embeddings unscaled": ("mup_embedding_mult", 8.0, 1.0),  # sqrt(64)
    # MuP's softmax scale without its base head dim: 1/sqrt(32), the heads' own, not 1/sqrt(query_pre_attn_scalar 256).
    "attention scaled by the head dim": ("mup_base_head_dim", 0.125, None),
}


@pytest.mark.parametrize("fault", ["sliding-window layers' rope theta the global one", *STORED_ARGS_FAULTS])
def test_an_injected_fault_moves_megatrons_logits(fault, converted, tmp_path):
    name = "gemma3-text-tp2pp2"
    _, reference, ckpt = converted(name)
    view = megatron_view
    if fault in STORED_ARGS_FAULTS:
        arg, right, wrong = STORED_ARGS_FAULTS[fault]
        faulty = shutil.copytree(ckpt, tmp_path / "mcore")
        assert getattr(read_args(iteration_dir(faulty)), arg) == right
        stored_args_changed(faulty, **{arg: wrong})
        ckpt = faulty
    else:
        assert read_args(iteration_dir(ckpt)).rotary_base == 1_000_000
        view = megatron_view_with_the_global_theta_on_sliding_window_layers
    assert (megatron_logits(ckpt, MODELS[name][3], view) - reference).abs().max() > 1e-2


def test_mconvert_verify_passes_on_cpu_ranks(converted):
    """The command a user runs, on the image-text checkpoint (transformers' reference its language model's layers) at
    the checkpoint's TP 2 (its prompts within the window: the weights are compared, the window itself above)."""
    hf, _, ckpt = converted("gemma3-vision-tp2")
    result = run_cli("verify", "--hf", hf, "--mcore", ckpt, "--tp", "2", "--device", "cpu")
    assert result.returncode == 0 and result.stdout.strip().endswith("PASS"), result.stdout + result.stderr
