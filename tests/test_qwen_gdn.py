"""Qwen3-Next, Qwen3.5 (image-text, dense) and Qwen3.5-MoE converted to torch_dist and checked by megatron-core
0.16.1's own GPTModel on gloo CPU ranks at TP 2 with EP 2 or PP 2: three gated delta-net layers, then one of
full attention with an output gate, q/k norms and partial rope, zero-centred norms, MoE with a gated shared
expert. megatron-core builds gated delta-net only under Transformer Engine; on CPU ranks its own GatedDeltaNet
runs with local linears and its PyTorch delta rule (mconvert.verify.cpu_shims). The prompts are 160
tokens, three chunks of the delta rule's 64. Injected faults (Qwen3-Next's per-key-head sections read flat, the
delta-net's output norm not shifted to zero-centred, the norms not zero-centred at all) each move megatron-core's logits away from transformers';
the conversion back is bit-exact, the vision tower copied from the original."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mconvert.dtypes import as_torch
from mconvert import mappings
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mappings import qwen3_next
from mconvert.mappings.transforms import Rename, Section
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import assert_one_line_error, run_cli
from tests.test_parallel import hf_tensors
from tests.test_moe_megatron import megatron_view

TOKENS = torch.randint(0, 1000, (2, 160), generator=torch.Generator().manual_seed(0))
# name: (config, layout, whether its experts are stored fused as on the hub)
CASES = {
    "qwen3-next-tp2ep2": ("qwen3-next-80b-a3b-instruct", Parallelism(tp=2, ep=2), False),
    "qwen3-next-pp2": ("qwen3-next-80b-a3b-instruct", Parallelism(pp=2), False),
    "qwen3.5-tp2pp2": ("qwen3.5-0.8b", Parallelism(tp=2, pp=2), False),
    "qwen3.5-moe-tp2ep2": ("qwen3.5-35b-a3b", Parallelism(tp=2, ep=2), True),
}


@pytest.fixture(scope="module")
def made(hf_model_factory):
    """config name -> its random-init HF checkpoint (4 layers), at std 0.1 so that attention is far from uniform;
    Qwen3.5-MoE's experts fused, as its hub checkpoints store them."""
    return lambda name: hf_model_factory(name, layers=4, weight_std=0.1, fused_experts=name == "qwen3.5-35b-a3b")


def hf_logits(hf_dir) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def megatron_logits(ckpt, parallelism: Parallelism) -> torch.Tensor:
    views = run_ranks(megatron_view, {"model": str(ckpt)}, TOKENS, tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, timeout_s=600)
    return views["model"][0][..., :1000]


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_gives_transformers_logits_and_the_export_is_bit_exact(case, made, tmp_path):
    name, parallelism, _ = CASES[case]
    hf = made(name)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    # fp32, summed in other orders over 160 positions of weights at std 0.1: differences of a few 1e-3 at most.
    torch.testing.assert_close(megatron_logits(tmp_path / "mcore", parallelism), hf_logits(hf), rtol=1e-3, atol=1e-2)
    # Back with the original as --hf-config: the image-text class, its vision tower copied from there.
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config_dir=hf)
    original, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", hf))
    assert written["architectures"] == read["architectures"] and written["model_type"] == read["model_type"]
    text, read_text = written.get("text_config", written), read.get("text_config", read)
    for field in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "head_dim"):
        assert text[field] == read_text[field], field


def test_the_prompts_run_the_delta_rule_over_several_chunks_and_the_conversion_back_needs_no_hf_config(made, tmp_path):
    """Without --hf-config the args name the family (Qwen3-Next: gated delta-net with experts), and the rows
    from 64 on depend on the delta rule's state carried across chunks."""
    hf = made("qwen3-next-80b-a3b-instruct")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    original, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        whole, tail = model(TOKENS).logits, model(TOKENS[:, 64:]).logits
    assert (whole[:, 64:] - tail).abs().max() > 1e-2


def flat(spec):
    """Qwen3.5's flat [q; k; v; z] in place of Qwen3-Next's per-key-head grouping."""
    la = spec.linear_attention
    return 1, (("query", la.key_dim), ("key", la.key_dim), ("value", la.value_dim), ("z", la.value_dim))


def without_zero_centred_norms(ckpt):
    """The args as if --apply-layernorm-1p were left out: every norm multiplies by w, not 1 + w."""
    common = iteration_dir(ckpt) / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].apply_layernorm_1p = state["args"].layernorm_zero_centered_gamma = False
    torch.save(state, common)


@pytest.mark.parametrize("fault", ["sections read flat", "output norm not zero-centred", "no --apply-layernorm-1p"])
def test_an_injected_fault_moves_megatrons_logits(fault, made, tmp_path, monkeypatch):
    entries = []
    for entry in qwen3_next.TABLE.linear_attention:
        if fault == "sections read flat" and isinstance(entry, Section) and "in_proj_qkvz" in entry.hf:
            entry = dataclasses.replace(entry, sections=flat)
        elif fault == "output norm not zero-centred" and entry.mcore.endswith("out_norm.weight"):
            entry = Rename(entry.mcore, entry.hf, split=entry.split)
        entries.append(entry)
    table = dataclasses.replace(qwen3_next.TABLE, linear_attention=tuple(entries))
    monkeypatch.setitem(mappings.FAMILIES, "qwen3_next", dataclasses.replace(qwen3_next.FAMILY, table=table))
    hf = made("qwen3-next-80b-a3b-instruct")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    if fault == "no --apply-layernorm-1p":
        without_zero_centred_norms(tmp_path / "mcore")
    assert (megatron_logits(tmp_path / "mcore", Parallelism(tp=2)) - hf_logits(hf)).abs().max() > 0.1


def test_multimodal_rope_for_text_is_the_rope_the_flags_build(made, monkeypatch):
    """Qwen3.5's interleaved multimodal rope (mrope_section) with the three position ids of text equal: the
    angles of megatron-core's rope over the rotated quarter of each head, at rope_theta."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where megatron-core puts the positions

    config = transformers.AutoConfig.from_pretrained(made("qwen3.5-0.8b")).text_config
    rope = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config)
    assert config.rope_parameters["mrope_section"] and config.rope_parameters["mrope_interleaved"]
    positions = torch.arange(160)[None].expand(3, 1, -1)  # (temporal, height, width) of text: all equal
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    megatron = RotaryEmbedding(
        kv_channels=config.head_dim, rotary_percent=config.rope_parameters["partial_rotary_factor"], rotary_base=config.rope_parameters["rope_theta"],
        use_cpu_initialization=True,
    )
    angles = megatron(160)[:, 0, 0]  # [positions, rotated dimensions]
    torch.testing.assert_close(cos[0], angles.cos(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[0], angles.sin(), rtol=1e-5, atol=1e-5)


def test_the_vision_tower_is_left_out_and_said_so_and_the_export_needs_the_original(made, tmp_path):
    hf = made("qwen3.5-0.8b")
    out = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert f"left out the vision tower of {hf}" in out.stdout
    assert "--experimental-attention-variant gated_delta_net" in out.stdout and "--apply-layernorm-1p" in out.stdout
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((hf / "config.json").read_text())
    failed = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back", "--hf-config", config_only)
    assert_one_line_error(failed, "--hf-config", "the vision tower", code=1)
    assert not (tmp_path / "back").exists()


def test_the_multi_token_prediction_layer_is_left_out_of_a_gpt_checkpoint_and_said_so(made, tmp_path):
    """The hub's Qwen3-Next holds its MTP layer under `mtp.` (transformers drops it): not converted for GPTModel, which
    cannot build it, and said so (HybridModel's conversion of it: tests/test_hybrid_layout.py)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    source = made("qwen3-next-80b-a3b-instruct")
    (hf / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    mtp = {"mtp.fc.weight": torch.zeros(hidden, 2 * hidden), "mtp.norm.weight": torch.zeros(hidden)}
    save_file({**tensors, **mtp}, hf / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore")
    assert out.returncode == 0, out.stderr
    assert f"left out 1 multi-token prediction layer(s) of {hf} ({qwen3_next.MTP_LEFT_OUT})" in out.stdout


def test_tp_above_the_query_groups_is_converted_and_megatron_core_0_16_says_it_cannot_run_it(made, tmp_path):
    """Qwen3-Next has 2 key-value heads: megatron-core takes TP 4 and 8 (a multiple of them), splitting the fused
    QKV's rows evenly; 0.16.1's output gate there is wrong, which verify says in one line (megatron-core 0.19.2
    runs it: tests/megatron_lm). TP 3, neither a divisor nor a multiple, is refused before anything is written."""
    hf = tmp_path / "hf"
    make_hf_checkpoint(shrink(real_config("qwen3-next-80b-a3b-instruct"), layers=4, linear_num_key_heads=4, linear_num_value_heads=8), hf)
    assert run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "4").returncode == 0
    failed = run_cli("verify", "--hf", hf, "--mcore", tmp_path / "mcore", "--tp", "4", "--device", "cpu")
    assert_one_line_error(failed, "TP 4", "query groups", "0.19", code=2)
    refused = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "tp3", "--tp", "3")
    assert_one_line_error(refused, "--tp 3", code=1)
    assert not (tmp_path / "tp3").exists()


def test_local_transformer_impl_is_refused_in_one_line(made, tmp_path):
    out = run_cli("hf-to-mcore", "--load-dir", made("qwen3.5-0.8b"), "--save-dir", tmp_path / "mcore", "--transformer-impl", "local")
    assert_one_line_error(out, "--transformer-impl local", "transformer_engine", code=1)
    assert not (tmp_path / "mcore").exists()


def test_qwen35_moe_experts_fused_or_one_by_one_convert_alike_and_go_back_as_the_original(made, tmp_path):
    """Qwen3.5-MoE's hub checkpoints hold each layer's experts fused; transformers' save_pretrained writes them one by
    one. Both layouts of the same weights make the same torch_dist checkpoint; the export writes them as the checkpoint
    `--hf-config` names stores them."""
    fused = made("qwen3.5-35b-a3b")
    one_by_one = make_hf_checkpoint(shrink(real_config("qwen3.5-35b-a3b"), layers=4), tmp_path / "hf-one-by-one", weight_std=0.1)
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in hf_tensors(one_by_one)
    for name, source in (("fused", fused), ("one-by-one", one_by_one)):
        convert_hf_to_mcore(source, tmp_path / name, parallelism=Parallelism(ep=2))
    stored = {name: DCPCheckpoint(iteration_dir(tmp_path / name)) for name in ("fused", "one-by-one")}
    keys = sorted(stored["fused"].shapes)
    assert keys == sorted(stored["one-by-one"].shapes)
    region = lambda dcp, key: as_torch(dcp.read_region(key, (0,) * len(dcp.shapes[key]), dcp.shapes[key]))  # noqa: E731
    assert all(torch.equal(region(stored["fused"], key), region(stored["one-by-one"], key)) for key in keys)
    for name, original in (("fused", fused), ("one-by-one", one_by_one)):
        convert_mcore_to_hf(tmp_path / "one-by-one", tmp_path / f"back-{name}", hf_config_dir=original)
        exported, expected = hf_tensors(tmp_path / f"back-{name}"), hf_tensors(original)
        assert exported.keys() == expected.keys(), name
        assert all(torch.equal(exported[key], expected[key]) for key in expected), name


def test_output_norms_of_a_bf16_source_are_stored_exactly_in_fp32_and_said_to_round_in_bf16(made, tmp_path):
    """Megatron stores the delta-net output norm's w as w - 1. From a bf16 source that difference is exact in fp32
    (a bf16 w outside [0.5, 2] needs more bits than bf16 has for w - 1), so a --dtype fp32 checkpoint holds it
    exactly and goes back bit for bit; a bf16 one rounds such weights, as Megatron's own bf16 parameter does, and
    the conversion says so."""
    source = made("qwen3-next-80b-a3b-instruct")
    tensors = {k: v.to(torch.bfloat16) for k, v in hf_tensors(source).items()}
    norm = "model.layers.0.linear_attn.norm.weight"
    tensors[norm][:4] = torch.tensor([0.3, -0.2, 3.7, 0.015625])  # w - 1 needs 9 to 14 significant bits
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), "dtype": "bfloat16"}))
    out = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "bf16")
    assert out.returncode == 0 and f"note: Megatron's norms multiply by 1 + w, so {norm} and 2 more are stored as w - 1" in out.stdout
    convert_hf_to_mcore(hf, tmp_path / "fp32", dtype=torch.float32)
    dcp = DCPCheckpoint(iteration_dir(tmp_path / "fp32"))
    key = "decoder.layers.0.self_attention.out_norm.weight"
    stored = as_torch(dcp.read_region(key, (0,), dcp.shapes[key]))
    assert torch.equal(stored, tensors[norm].float() - 1)
    convert_mcore_to_hf(tmp_path / "fp32", tmp_path / "back", dtype=torch.bfloat16)
    back = hf_tensors(tmp_path / "back")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
