"""MiniMax-M2 converted to torch_dist and checked by megatron-core 0.16.1 (its GPTModel, local spec, gloo CPU ranks) at
TP 2 x EP 2 and PP 2: q and k each RMS-normalised over all heads of the layer (mconvert's layer spec, split across
TP ranks with the heads), rope on half of each head, experts in every layer routed by sigmoid scores with a routing
bias that only chooses them. The routing biases are random (transformers initialises them to zero), so that they
change which experts run. Injected faults are caught: the routing bias zeroed moves megatron-core's logits, and so do
mconvert's q/k norms at TP 2 without their forward sum over the ranks (each rank's heads normalised alone); q/k norms
per head, or over each TP rank's heads alone, would move transformers' own logits far beyond the comparison's
tolerance; the norm's gradient without its backward sum over the ranks differs from one rank's."""

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
from mconvert.mappings import minimax_m2
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from tests.test_gpt_oss import Zeroed
from tests.test_moe_megatron import megatron_view
from tests.test_remote_code import MARKER_CODE

TOKENS = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
LAYOUTS = {"tp2-ep2": Parallelism(tp=2, ep=2), "pp2": Parallelism(pp=2)}
SPEC_FLAG = "--spec mconvert.megatron_lm.layer_specs gpt_layers_with_qk_norm_across_heads"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """MiniMax-M2.7's config.json shrunk (auto_map kept), weights at std 0.1, random routing biases of about the
    sigmoid scores' spread, and the checkpoint's own code placed beside them."""
    config = shrink(real_config("minimax-m2.7"), layers=2)
    hf = make_hf_checkpoint(config, tmp_path_factory.mktemp("minimax") / "hf", weight_std=0.1)
    tensors = load_file(hf / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in [name for name in tensors if name.endswith("e_score_correction_bias")]:
        tensors[name] = 0.2 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    for module in ("configuration_minimax_m2.py", "modeling_minimax_m2.py"):
        (hf / module).write_text(MARKER_CODE)
    return hf


def hf_model(hf_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def hf_logits(hf_dir) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(hf_dir)(TOKENS).logits


def megatron_logits(ckpt, parallelism: Parallelism) -> torch.Tensor:
    views = run_ranks(megatron_view, {"model": str(ckpt)}, TOKENS, tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep)
    return views["model"][0][..., :1000]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_core_gives_transformers_logits_and_the_export_is_bit_exact(layout, hf, tmp_path):
    parallelism = LAYOUTS[layout]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    torch.testing.assert_close(megatron_logits(tmp_path / "mcore", parallelism), hf_logits(hf), rtol=1e-4, atol=1e-4)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")  # from the stored args alone
    original = load_file(hf / "model.safetensors")
    back = {k: v for path in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(path).items()}
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", hf))
    for field in ("model_type", "rotary_dim", "qk_norm_type", "num_local_experts", "num_experts_per_tok", "head_dim"):
        assert written[field] == read[field], field


def per_head(x, weight, eps, heads):
    rows = x.float().unflatten(-1, (heads, -1))
    return weight * (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("groups", ["per head", "per TP rank's heads"])
def test_other_q_k_norms_move_transformers_logits_far_beyond_the_tolerance(groups, hf):
    """Norms over fewer heads than the layer's (each head, or the half that one of two TP ranks holds, had the sum of
    squares not been summed over the ranks) give other logits: the prompts are such that the comparisons above would
    catch them (the second in mconvert's own layer spec: test_the_norm_without_its_sum_over_tp_ranks_...)."""
    model, reference = hf_model(hf), hf_logits(hf)
    for layer in model.model.layers:
        for norm, heads in ((layer.self_attn.q_norm, 4), (layer.self_attn.k_norm, 2)):
            parts = heads if groups == "per head" else 2
            norm.forward = lambda x, norm=norm, parts=parts: per_head(x, norm.weight, norm.variance_epsilon, parts)
    with torch.no_grad():
        assert (model(TOKENS).logits - reference).abs().max() > 1e-2


def megatron_view_without_the_sum_over_tp_ranks(ckpt_dirs: dict[str, str], tokens: torch.Tensor):
    """In each rank: megatron_view with mconvert's q/k norms across heads normalising each rank's heads by their own
    sum of squares (the forward all-reduce over the tensor-parallel ranks left out)."""
    from mconvert.megatron_lm import layer_specs

    layer_specs.RMSNormAcrossHeads.sum_over_ranks = lambda self, squares: squares
    return megatron_view(ckpt_dirs, tokens)


def test_the_norm_without_its_sum_over_tp_ranks_moves_megatrons_logits(hf, tmp_path):
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    views = run_ranks(megatron_view_without_the_sum_over_tp_ranks, {"model": str(tmp_path / "mcore")}, TOKENS, tp=2)
    assert (views["model"][0][..., :1000] - hf_logits(hf)).abs().max() > 1e-2


def test_a_zeroed_routing_bias_moves_megatrons_logits(hf, tmp_path, monkeypatch):
    moe_mlp = tuple(Zeroed(e.mcore, e.hf, split=e.split) if e.mcore == "mlp.router.expert_bias" else e for e in minimax_m2.TABLE.moe_mlp)
    family = dataclasses.replace(minimax_m2.FAMILY, table=dataclasses.replace(minimax_m2.TABLE, moe_mlp=moe_mlp))
    monkeypatch.setitem(mappings.FAMILIES, "minimax_m2", family)
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    assert (megatron_logits(tmp_path / "mcore", Parallelism()) - hf_logits(hf)).abs().max() > 1e-2


def norm_gradients(inputs: torch.Tensor, summed_backward: bool):
    """In each of two TP ranks: the norm across heads of its half of `inputs`' heads, and its input gradient of a loss
    that weighs every output, gathered. With `summed_backward` False, the injected fault: the sum of squares
    all-reduced as a plain tensor (summed in the forward pass only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mconvert.megatron_lm import layer_specs

    class SummedForwardOnly(layer_specs.QueryNormAcrossHeads):
        def sum_over_ranks(self, squares):
            total = squares.detach().clone()
            dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
            return squares + (total - squares.detach())

    rank, tp = parallel_state.get_tensor_model_parallel_rank(), 2
    norm = (layer_specs.QueryNormAcrossHeads if summed_backward else SummedForwardOnly)(8, tiny_config(tp), eps=1e-6)
    norm.weight.data = WEIGHT.chunk(tp)[rank].clone()
    x = inputs.chunk(tp, dim=2)[rank].clone().requires_grad_()
    (norm(x) * LOSS_WEIGHTS.chunk(tp, dim=2)[rank]).sum().backward()
    gathered = [torch.empty_like(x.grad) for _ in range(tp)]
    dist.all_gather(gathered, x.grad)
    return torch.cat(gathered, dim=2)


WEIGHT = torch.arange(32.0) / 20 + 0.5  # 4 heads of 8
LOSS_WEIGHTS = torch.linspace(-1, 1, 3 * 4 * 8).view(3, 1, 4, 8)


def tiny_config(tp: int):
    return type("Config", (), {"tensor_model_parallel_size": tp, "num_attention_heads": 4, "params_dtype": torch.float32})


def test_the_norm_across_heads_has_one_ranks_gradient_at_tp2():
    from mconvert.megatron_lm import layer_specs

    inputs = torch.randn(3, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    norm = layer_specs.QueryNormAcrossHeads(8, tiny_config(1), eps=1e-6)
    norm.weight.data = WEIGHT.clone()
    x = inputs.clone().requires_grad_()
    (norm(x) * LOSS_WEIGHTS).sum().backward()
    torch.testing.assert_close(run_ranks(norm_gradients, inputs, True, tp=2), x.grad)
    assert (run_ranks(norm_gradients, inputs, False, tp=2) - x.grad).abs().max() > 1e-3


def test_the_summary_says_how_it_was_read_and_the_flags_build_it(hf, tmp_path):
    """Read as transformers' own class without running the shipped code; the multi-token prediction layers a hub
    checkpoint holds after the decoder's are left out and said; the flags carry the layer spec."""
    with_mtp = tmp_path / "hf"
    with_mtp.mkdir()
    for file in hf.iterdir():
        if file.name != "model.safetensors":
            (with_mtp / file.name).symlink_to(file)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP module after the 2 decoder layers
    save_file(tensors, with_mtp / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("hf-to-mcore", "--load-dir", with_mtp, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2")
    assert out.returncode == 0, out.stderr
    assert "model_type 'minimax_m2' ships its own code (auto_map), which was not run: read as transformers' built-in MiniMaxM2ForCausalLM" in out.stdout
    assert "left out 1 multi-token prediction layer(s)" in out.stdout and minimax_m2.MTP_LEFT_OUT in out.stdout
    script = (tmp_path / "mcore" / "megatron_args.sh").read_text()
    assert SPEC_FLAG in script and "--qk-layernorm" in script and "--rotary-percent 0.5" in script
    assert "--moe-router-score-function sigmoid" in script and "--moe-router-enable-expert-bias" in script
    assert "install mconvert where Megatron-LM runs" in script
    assert read_args(iteration_dir(tmp_path / "mcore")).spec == SPEC_FLAG.split()[1:]
    assert not (hf / "CODE_WAS_RUN").exists()


def test_tp_above_the_key_heads_is_one_line(hf, tmp_path):
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out", "--tp", "4")
    assert_one_line_error(result, "--tp 4", "num_key_value_heads (2)", "across heads")
    assert_nothing_left(tmp_path / "out")


def test_fp8_hub_weights_convert_as_their_dequantized_values(tmp_path):
    """MiniMax-M2 as released stores its linear layers, experts' w1/w2/w3 among them, in FP8 with block scales."""
    from mconvert.formats.dcp import DCPCheckpoint
    from mconvert.full_size import write_random_hf_checkpoint
    from tests.test_fp8 import BLOCK, dequantize

    released = real_config("minimax-m2.7")
    config = {**shrink(released, layers=1), "torch_dtype": "bfloat16",
              "quantization_config": {**released["quantization_config"], "weight_block_size": list(BLOCK)}}
    hf = write_random_hf_checkpoint(config, tmp_path / "hf", quantized=True)
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn and tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.bfloat16
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(ep=2), dtype=torch.float32)
    dcp = DCPCheckpoint(iteration_dir(tmp_path / "mcore"))
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    converted = as_torch(dcp.read_region(key, (0,) * len(dcp.shapes[key]), dcp.shapes[key]))[0, 3]
    assert torch.equal(converted, dequantize(tensors[name], tensors[name + "_scale_inv"]))


def test_verify_passes_and_names_a_transformers_that_ignores_rotary_dim(hf, tmp_path):
    """`mconvert verify` passes at TP 2 x EP 2. A transformers that runs rope on every dim while config.json says
    rotary_dim (5.17 ignores that field; here rope_parameters' partial_rotary_factor 1 makes 5.24 do the same) is named in
    one line, instead of a FAIL that would blame the conversion."""
    assert run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "2", "--ep", "2").returncode == 0
    verify = ("verify", "--mcore", tmp_path / "mcore", "--device", "cpu", "--tp", "2", "--ep", "2")
    passed = run_cli(*verify, "--hf", hf)
    assert passed.returncode == 0 and passed.stdout.strip().endswith("PASS"), passed.stdout + passed.stderr
    misread = tmp_path / "misread"
    misread.mkdir()
    for file in hf.iterdir():
        if file.name != "config.json":
            (misread / file.name).symlink_to(file)
    config = json.loads((hf / "config.json").read_text())
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5  # as transformers saves it
    (misread / "config.json").write_text(json.dumps({**config, "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 1.0}}))
    assert_one_line_error(run_cli(*verify, "--hf", misread), "config.json", "rotary_dim says 16", "upgrade transformers", code=2)
