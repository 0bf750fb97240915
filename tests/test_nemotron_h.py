"""Nemotron-H (`nemotron_h`): Mamba-2 layers beside attention without rope, relu^2 MLPs and sigmoid-routed experts,
one block an HF layer, which only HybridModel holds. Converted at TP 2 x EP 2 into the keys megatron-core 0.19.2's
MambaMixer stores (in_proj's z, x, B, C, dt and the convolution's x, B, C under keys of their own), and back bit for
bit with a config.json transformers builds the same model from; what megatron-core fixes and a config varies, and
the GPT model class, refused in one line. megatron-core's and Megatron-LM's checks: tests/megatron_lm/test_nemotron_h.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mconvert.dtypes import as_torch
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left, assert_one_line_error, run_cli

CONFIG = "nemotron-3-nano-30b-a3b"
PATTERN = "M-M*EME"
# Nemotron 3 Super: latent MoE (experts of width 24 in the shrunk model, beside hidden 64 and expert width 32).
SUPER = "nemotron-3-super-120b-a12b"
SUPER_PATTERN = "ME*E"


@pytest.fixture(scope="module")
def hf(hf_model_factory):
    return hf_model_factory(CONFIG, layers=len(PATTERN), weight_std=0.1, hybrid_override_pattern=PATTERN)


def weights(directory):
    return {name: tensor for path in sorted(directory.glob("*.safetensors")) for name, tensor in load_file(path).items()}


def test_the_hybrid_checkpoint_has_megatron_cores_mamba_keys_and_converts_back_bit_for_bit(hf, tmp_path):
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2, model_class="hybrid"))
    args = read_args(iteration_dir(tmp_path / "mcore"))
    assert args.hybrid_layer_pattern == PATTERN and args.num_layers == len(PATTERN)
    assert (args.mamba_num_heads, args.mamba_head_dim, args.mamba_num_groups, args.mamba_state_dim) == (8, 8, 2, 16)
    assert args.squared_relu and not args.swiglu and args.position_embedding_type == "none"
    dcp = DCPCheckpoint(iteration_dir(tmp_path / "mcore"))
    stored = lambda key: as_torch(dcp.read_region(key, (0,) * len(dcp.shapes[key]), dcp.shapes[key]))  # noqa: E731
    original = weights(hf)
    in_proj = original["backbone.layers.0.mixer.in_proj.weight"]
    conv = original["backbone.layers.0.mixer.conv1d.weight"]
    for name, rows in zip("z x B C dt".split(), in_proj.split([64, 64, 32, 32, 8])):
        assert torch.equal(stored(f"decoder.layers.0.mixer.in_proj.weight.{name}"), rows), name
    for name, rows in zip("x B C".split(), conv.split([64, 32, 32])):
        assert torch.equal(stored(f"decoder.layers.0.mixer.conv1d.weight.{name}"), rows), name
    assert {"decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.layers.0.mixer.conv1d.bias.C",
            "decoder.layers.3.self_attention.linear_qkv.weight", "decoder.layers.4.mlp.experts.experts.linear_fc1.weight",
            "decoder.layers.4.mlp.router.expert_bias", "decoder.final_norm.weight"} <= set(dcp.shapes)
    assert dcp.shapes["decoder.layers.1.mlp.linear_fc1.weight"] == (128, 64)  # no gate: ffn rows, not 2 x ffn
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    back = weights(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["hybrid_override_pattern"] == PATTERN
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert [layer.block_type for layer in model.model.layers] == [
        "linear_attention", "mlp", "linear_attention", "full_attention", "moe", "linear_attention", "moe"
    ]


def test_super_has_megatron_cores_latent_moe_and_mtp_keys_and_converts_back_bit_for_bit(hf_model_factory, tmp_path):
    """Nemotron 3 Super's latent MoE: the projections into the experts' width and back are megatron-core's
    `mlp.fc1_latent_proj` and `mlp.fc2_latent_proj`, whole on every TP rank (Transformer Engine's duplicated linears);
    the experts' fc1 reads and fc2 writes the latent width, split by rows and columns over the expert TP ranks. Its MTP
    layer (blocks `*E`, HF layers `mtp.layers.0.` and `.1.`) is HybridModel's `/*E`: its own norms and projection in
    `mtp.layers.0.`, its blocks in `mtp.layers.0.mtp_model_layer.layers.<j>.`."""
    hf = hf_model_factory(SUPER, layers=len(SUPER_PATTERN), hybrid_override_pattern=SUPER_PATTERN, mtp=True)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2, model_class="hybrid"))
    args = read_args(iteration_dir(tmp_path / "mcore"))
    assert (args.moe_latent_size, args.hybrid_layer_pattern, args.mtp_num_layers) == (24, SUPER_PATTERN + "/*E", 1)
    dcp = DCPCheckpoint(iteration_dir(tmp_path / "mcore"))
    chunks = lambda key: sorted(tuple(chunk.sizes) for chunk in dcp.metadata.state_dict_metadata[key].chunks)  # noqa: E731
    original = weights(hf)
    for layer, hf_layer in (("decoder.layers.1.", "backbone.layers.1."), ("mtp.layers.0.mtp_model_layer.layers.1.", "mtp.layers.1.")):
        assert chunks(layer + "mlp.fc1_latent_proj.weight") == [(24, 64)] and chunks(layer + "mlp.fc2_latent_proj.weight") == [(64, 24)]
        assert dcp.shapes[layer + "mlp.experts.experts.linear_fc1.weight"] == (8, 32, 24)
        assert chunks(layer + "mlp.experts.experts.linear_fc1.weight") == [(1, 16, 24)] * 16
        assert chunks(layer + "mlp.experts.experts.linear_fc2.weight") == [(1, 24, 16)] * 16
        stored = as_torch(dcp.read_region(layer + "mlp.fc2_latent_proj.weight", (0, 0), (64, 24)))
        assert torch.equal(stored, original[hf_layer + "mixer.fc2_latent_proj.weight"])
    assert dcp.shapes["mtp.layers.0.eh_proj.weight"] == (64, 128)
    assert torch.equal(as_torch(dcp.read_region("mtp.layers.0.final_layernorm.weight", (0,), (64,))), original["mtp.layers.1.final_layernorm.weight"])
    assert "mtp.layers.0.mtp_model_layer.layers.0.self_attention.linear_qkv.weight" in dcp.shapes
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    back = weights(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[name], original[name]) for name in original)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["moe_latent_size"], config["num_nextn_predict_layers"], config["mtp_hybrid_override_pattern"]) == (24, 1, "*E")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_a_save_without_megatron_lms_args_is_read_as_a_hybrid_model(hf, tmp_path):
    """ms-swift saves Nemotron-H as a HybridModel with its own training arguments in place of Megatron-LM's (no model in
    them; found beside the peers on the GPU host): given --hf-config, mcore-to-hf takes it as HybridModel, the only
    model that holds Nemotron-H's layers, bit for bit; taken as GPTModel it was refused."""
    import argparse

    from mconvert.formats.torch_save import saved_bytes

    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(ep=2, model_class="hybrid"))
    common = iteration_dir(tmp_path / "mcore") / "common.pt"
    common.write_bytes(saved_bytes({"args": argparse.Namespace(lr=1e-5, tensor_model_parallel_size=1), "iteration": 0}))
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config_dir=hf)
    back, original = weights(tmp_path / "back"), weights(hf)
    assert back.keys() == original.keys() and all(torch.equal(back[name], original[name]) for name in original)


def test_inspect_shows_the_pattern_of_both_checkpoints(hf, tmp_path):
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, model_class="hybrid"))
    result = run_cli("inspect", tmp_path / "mcore")
    assert result.returncode == 0, result.stderr
    assert f"HybridModel TP=2 PP=1 EP=1 ETP=2 --hybrid-layer-pattern '{PATTERN}'" in result.stdout, result.stdout
    result = run_cli("inspect", hf)
    assert result.returncode == 0, result.stderr
    assert f"layer_blocks={PATTERN}, mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16" in result.stdout, result.stdout


def test_a_mamba_tensor_of_another_shape_than_the_config_says_is_refused_in_one_line(hf, tmp_path):
    """Twice the heads in config.json: in_proj's rows (2 x inner + 2 x groups x state + heads) are not the stored ones."""
    (tmp_path / "hf").mkdir()
    for path in hf.iterdir():
        (tmp_path / "hf" / path.name).symlink_to(path)
    (tmp_path / "hf" / "config.json").unlink()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), "mamba_num_heads": 16}))
    result = run_cli("hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out", "--model-class", "hybrid")
    assert_one_line_error(result, "backbone.layers.0.mixer.in_proj.weight", "[200, 64]", "[336, 64]")
    assert_nothing_left(tmp_path / "out")


def test_the_gpt_model_class_is_refused_in_one_line(hf, tmp_path):
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out")
    assert_one_line_error(result, "--model-class gpt", "only HybridModel", "use --model-class hybrid")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("field, value, why", [
    ("conv_kernel", 3, "megatron-core"), ("chunk_size", 256, "megatron-core"), ("mamba_hidden_act", "gelu", "megatron-core"),
    ("use_conv_bias", False, "megatron-core"), ("use_bias", True, "megatron-core"), ("layer_norm_epsilon", 1e-6, "megatron-core"),
    ("mlp_hidden_act", "silu", "converts 'relu2' only"), ("moe_latent_size", 0, "not a positive integer"),
    ("mtp_hybrid_override_pattern", "*G", "not made of M, *, - and E"),
])
def test_what_megatron_core_fixes_or_is_not_converted_is_refused_in_one_line_naming_the_field(field, value, why, tmp_path):
    config = shrink(real_config(CONFIG), layers=4, hybrid_override_pattern="M*-E")
    hf = make_hf_checkpoint(config, tmp_path / "hf")
    mtp = {"num_nextn_predict_layers": 1} if field.startswith("mtp_") else {}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), field: value, **mtp}))
    result = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "out", "--model-class", "hybrid")
    assert_one_line_error(result, field, why)
    assert_nothing_left(tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="mamba_ssm is installed here")
def test_verify_without_mamba_ssm_says_what_to_install_in_one_line(hf, tmp_path):
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(model_class="hybrid"))
    result = run_cli("verify", "--hf", hf, "--mcore", tmp_path / "mcore", "--device", "cpu")
    assert_one_line_error(result, "Mamba layers", "mamba_ssm", "MAMBA_SKIP_CUDA_BUILD=TRUE", code=2)
