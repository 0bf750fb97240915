"""megatron-core 0.19.2 and Megatron-LM 0.19.2 check mconvert's Nemotron-H checkpoints (Python 3.12; CPU gloo ranks,
fp32): megatron-core's HybridModel, built from the checkpoint's args alone (`mconvert verify`), strict-loads them at TP 1,
TP 2 x EP 2 and PP 2 and gives transformers' logits, on a prompt of two of the Mamba scan's 128-token chunks too;
Megatron-LM's parser reads the printed flags as the stored model, its pretrain_hybrid.py builder and own
`load_checkpoint` give transformers' logits, and its own save exports to the HF weights bit for bit. On CPU ranks the
Mamba mixer runs mamba_ssm's PyTorch references in place of its Triton kernels (mconvert.verify.mamba). Injected
faults (in_proj's z and x sections swapped, the convolution's B and C) each fail the comparison."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package: the Python 3.12 environment")
    if importlib.util.find_spec("mamba_ssm") is None or importlib.util.find_spec("einops") is None:
        pytest.skip("megatron-core's Mamba layers need mamba_ssm and einops (scripts/install312.sh)", allow_module_level=True)

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from mconvert import mappings  # noqa: E402
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.mappings import nemotron_h  # noqa: E402
from mconvert.mappings.transforms import Section, Transpose  # noqa: E402
from mconvert.mcore.checkpoint import iteration_dir, read_args  # noqa: E402
from mconvert.mcore.parallelism import Parallelism, PipelineSplit  # noqa: E402
from mconvert.synthetic import write_word_tokenizer  # noqa: E402
from mconvert.verify.distributed import run_ranks  # noqa: E402
from mconvert.verify.megatron_lm import (  # noqa: E402
    CPU_FLAGS,
    RUN_FLAGS,
    load_as_megatron_lm,
    parse_megatron_lm_args,
    script_arrays,
)
from mconvert.verify.megatron_side import forward_logits  # noqa: E402
from mconvert.verify.run import VerifyRequest, verify  # noqa: E402

CONFIG = "nemotron-3-nano-30b-a3b"
SUPER, SUPER_PATTERN = "nemotron-3-super-120b-a12b", "ME*E"
# Mamba, MLP, attention and MoE layers, each kind twice but attention.
PATTERN = "M-M*EME"
# Two of the Mamba scan's 128-token chunks.
TOKENS = torch.randint(0, 1000, (2, 160), generator=torch.Generator().manual_seed(0))
LAYOUTS = {
    "tp1": Parallelism(model_class="hybrid"),
    "tp2ep2": Parallelism(tp=2, ep=2, model_class="hybrid"),
    # Two stages, the pattern's `|` after the third layer: 'M-M|*EME'.
    "pp2": Parallelism(pp=2, pipeline=PipelineSplit(first_stage_layers=3), model_class="hybrid"),
}
# What the hybrid tests hold megatron-core's logits to (tests/megatron_lm/test_hybrid.py).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf(hf_model_factory):
    # Matrices at std 0.1: attention far from uniform, the Mamba states far from their inputs.
    made = hf_model_factory(CONFIG, layers=len(PATTERN), weight_std=0.1, hybrid_override_pattern=PATTERN)
    if not (made / "tokenizer.json").exists():
        write_word_tokenizer(made, 1000)
    return made


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
    made = {}
    for name, parallelism in LAYOUTS.items():
        made[name] = tmp_path_factory.mktemp(f"nemotron-h-{name}") / "mcore"
        convert_hf_to_mcore(hf, made[name], parallelism=parallelism)
    return made


def hf_logits(hf) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("name", LAYOUTS)
def test_megatron_cores_hybrid_model_loads_the_checkpoint_with_transformers_logits(name, hf, converted):
    report = verify(VerifyRequest(hf, converted[name], dataclasses.replace(LAYOUTS[name], model_class="gpt")))
    assert report.passed and report.first_diverging_layer is None, report.table()
    assert max(prompt.tokens for prompt in report.prompts) > 128
    assert all(prompt.max_abs_diff < TOLERANCE for prompt in report.prompts), report.table()


def test_megatron_lm_parses_the_printed_flags_as_the_stored_model(converted):
    ckpt = converted["tp2ep2"]
    parsed = parse_megatron_lm_args(script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS, 4)
    stored = read_args(iteration_dir(ckpt))
    assert stored.hybrid_layer_pattern == PATTERN
    for arg in ("hybrid_layer_pattern", "num_layers", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
                "squared_relu", "swiglu", "position_embedding_type", "kv_channels", "num_query_groups", "moe_router_score_function",
                "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "spec"):
        assert getattr(parsed, arg) == getattr(stored, arg), arg


def load_and_save(argv: list[str], save: str) -> torch.Tensor:
    from megatron.training.checkpointing import save_checkpoint

    model, _ = load_as_megatron_lm(argv + ["--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng"])
    save_checkpoint(3, model, None, None, 0)
    return forward_logits(model, TOKENS)


@pytest.mark.parametrize("model", ["nano", "super"])
def test_megatron_lm_loads_the_checkpoint_and_its_save_exports_bit_identically(model, request, tmp_path):
    """Nemotron 3 Super's too: its latent MoE, and its MTP layer, which its save holds and exports to the hub's
    `mtp.layers.*` tensors."""
    hf, ckpt = (request.getfixturevalue("hf"), request.getfixturevalue("converted")["tp2ep2"]) if model == "nano" else (
        request.getfixturevalue("super_hf"), request.getfixturevalue("super_converted"))
    argv = script_arrays(ckpt, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS
    logits = run_ranks(load_and_save, argv, str(tmp_path / "run"), tp=2, ep=2, timeout_s=600)
    torch.testing.assert_close(logits[..., :1000], hf_logits(hf), rtol=TOLERANCE, atol=TOLERANCE)
    subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "hf")],
        check=True, capture_output=True,
    )
    original = {k: v for path in hf.glob("*.safetensors") for k, v in load_file(path).items()}
    exported = {k: v for path in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(path).items()}
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


@pytest.fixture(scope="module")
def super_hf(hf_model_factory):
    """Nemotron 3 Super shrunk: latent MoE (experts of width 24 beside hidden 64) after Mamba and attention layers,
    and its MTP layer (attention, then latent MoE) as the hub holds it."""
    made = hf_model_factory(SUPER, layers=len(SUPER_PATTERN), weight_std=0.1, hybrid_override_pattern=SUPER_PATTERN, mtp=True)
    if not (made / "tokenizer.json").exists():
        write_word_tokenizer(made, 1000)
    return made


@pytest.fixture(scope="module")
def super_converted(super_hf, tmp_path_factory):
    made = tmp_path_factory.mktemp("nemotron-3-super") / "mcore"
    convert_hf_to_mcore(super_hf, made, parallelism=LAYOUTS["tp2ep2"])
    return made


def test_megatron_cores_latent_moe_loads_super_with_transformers_logits(super_hf, super_converted):
    """megatron-core's HybridModel with moe_latent_size (the MoE layer's latent projections are Transformer Engine's
    duplicated linears, a stand-in on CPU ranks: mconvert.verify.cpu_shims.moe_latent_projections_without_te) and its
    MTP layer (`/*E`) strict-loads the TP 2 x EP 2 checkpoint, run at TP 2 x EP 2, with transformers' logits."""
    assert read_args(iteration_dir(super_converted)).hybrid_layer_pattern == SUPER_PATTERN + "/*E"
    report = verify(VerifyRequest(super_hf, super_converted, Parallelism(tp=2, ep=2)))
    assert report.passed and report.first_diverging_layer is None, report.table()
    assert all(prompt.max_abs_diff < TOLERANCE for prompt in report.prompts), report.table()


def test_latent_projections_each_read_from_the_other_fail_the_comparison(super_hf, tmp_path, monkeypatch):
    """fc1_latent_proj [latent, hidden] and fc2_latent_proj [hidden, latent] written each as the other's transpose:
    every shape kept, the checkpoint loads; the logits fail from the first MoE layer on."""
    family = mappings.FAMILIES["nemotron_h"]
    faulty = tuple(
        Transpose(e.mcore, e.hf_names[0].replace(*(("fc1", "fc2") if "fc1" in e.mcore else ("fc2", "fc1"))), when=e.when, split=e.split)
        if "latent_proj" in e.mcore else e
        for e in nemotron_h.MOE_MLP
    )
    monkeypatch.setitem(mappings.FAMILIES, "nemotron_h", dataclasses.replace(family, table=dataclasses.replace(family.table, moe_mlp=faulty)))
    convert_hf_to_mcore(super_hf, tmp_path / "faulty", parallelism=LAYOUTS["tp1"])
    report = verify(VerifyRequest(super_hf, tmp_path / "faulty", Parallelism()))
    assert not report.passed and report.first_diverging_layer == 1, report.table()


def _swapped(entries: tuple, tensor: str, first: str, second: str) -> tuple:
    """The table's entries with two sections of the Megatron tensor `tensor` each read from the other's rows."""
    other = {first: second, second: first}
    return tuple(dataclasses.replace(e, section=other[e.section]) if isinstance(e, Section) and e.section in other
                 and e.mcore.startswith(tensor + ".") else e for e in entries)


@pytest.mark.parametrize("tensor, first, second", [("mixer.in_proj.weight", "z", "x"), ("mixer.conv1d.weight", "B", "C")],
                         ids=["in_proj-z-x", "conv1d-B-C"])
def test_an_injected_section_swap_fails_the_comparison(tensor, first, second, hf, tmp_path, monkeypatch):
    """z and x are both d_inner rows of in_proj, B and C both n_groups x state rows of the convolution: a swap keeps
    every shape and loads; only the logits tell, from the first layer on."""
    family = mappings.FAMILIES["nemotron_h"]
    table = dataclasses.replace(family.table, mamba=_swapped(nemotron_h.MAMBA, tensor, first, second))
    monkeypatch.setitem(mappings.FAMILIES, "nemotron_h", dataclasses.replace(family, table=table))
    convert_hf_to_mcore(hf, tmp_path / "faulty", parallelism=LAYOUTS["tp1"])
    report = verify(VerifyRequest(hf, tmp_path / "faulty", Parallelism()))
    assert not report.passed and report.first_diverging_layer == 0, report.table()
