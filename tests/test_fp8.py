"""Block-quantized FP8 checkpoints (DeepSeek-V3's hub format: `X` in float8_e4m3fn and `X_scale_inv`, one fp32
scale per block) convert as their dequantized values: the test quantizes a checkpoint itself, dequantizes it
again independently of the reader, and the two conversions must agree bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.dtypes import as_torch
from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.full_size import is_fp8_on_the_hub, write_random_hf_checkpoint
from mconvert.mcore.checkpoint import RELEASE
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import run_cli

# Smaller than the hub's 128 x 128, and not square, so that the test's widths (24 to 128) span several
# blocks, some partial.
BLOCK = (16, 32)


def quantize(weight: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale_inv per block) as DeepSeek's block quantization makes them; `power_of_two`: each scale
    rounded up to a power of two (DeepSeek-V3.2's ue8m0 scales)."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scale_inv = torch.empty(grid)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]].float()
            scale_inv[i, j] = block.abs().max() / 448.0
            if power_of_two:
                scale_inv[i, j] = 2.0 ** torch.ceil(torch.log2(scale_inv[i, j]))
            quantized[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (block / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def dequantize(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    out = quantized.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] *= scale_inv[i, j]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(FP8 checkpoint, the same dequantized by this test), both with the hub's config."""
    root = tmp_path_factory.mktemp("fp8")
    source = make_hf_checkpoint(shrink(real_config("deepseek-v3")), root / "source")
    fp8, dequantized = root / "fp8", root / "dequantized"
    tensors = load_file(source / "model.safetensors")
    quantized = {name: quantize(t) for name, t in tensors.items() if is_fp8_on_the_hub(name)}
    assert len(quantized) > 20
    fp8_tensors, plain_tensors = dict(tensors), dict(tensors)
    for name, (q, scale_inv) in quantized.items():
        fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale_inv
        plain_tensors[name] = dequantize(q, scale_inv)
    config = json.loads((source / "config.json").read_text())
    for directory, content, extra in ((fp8, fp8_tensors, {"quantization_config": {**real_config("deepseek-v3")["quantization_config"], "weight_block_size": list(BLOCK)}}), (dequantized, plain_tensors, {})):
        directory.mkdir()
        save_file(content, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
    return fp8, dequantized


def stored(ckpt):
    dcp = DCPCheckpoint(ckpt / RELEASE)
    keys = sorted(dcp.shapes)
    return {key: as_torch(dcp.read_region(key, (0,) * len(dcp.shapes[key]), dcp.shapes[key])) for key in keys}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_converts_as_its_dequantized_values(checkpoints, dtype, tmp_path):
    fp8, dequantized = checkpoints
    for name, source in (("fp8", fp8), ("plain", dequantized)):
        convert_hf_to_mcore(source, tmp_path / name, parallelism=Parallelism(tp=2, ep=2), dtype=dtype)
    from_fp8, from_plain = stored(tmp_path / "fp8"), stored(tmp_path / "plain")
    assert sorted(from_fp8) == sorted(from_plain)
    assert all(torch.equal(from_fp8[key], from_plain[key]) for key in from_plain)
    assert from_fp8["decoder.layers.0.self_attention.linear_q_down_proj.weight"].dtype == dtype


def test_verify_checks_an_fp8_source_by_transformers_dequantization(tmp_path):
    """`verify` runs transformers on its own dequantization of the FP8 blocks (its FP8 kernels would compute other
    numbers, and need a GPU of a recent kind): the checkpoint converted from them gives its logits."""
    # transformers' dequantization takes the block size from the grid of scales, so it needs whole blocks
    config = {**shrink(real_config("deepseek-v3")), "torch_dtype": "bfloat16",
              "quantization_config": {**real_config("deepseek-v3")["quantization_config"], "weight_block_size": [8, 8]}}
    fp8 = write_random_hf_checkpoint(config, tmp_path / "fp8", quantized=True)
    convert_hf_to_mcore(fp8, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2))
    result = run_cli("verify", "--hf", fp8, "--mcore", tmp_path / "mcore", "--tp", "2", "--ep", "2", "--device", "cpu")
    assert result.returncode == 0 and result.stdout.strip().endswith("PASS"), result.stdout + result.stderr


def test_verify_of_an_fp8_source_transformers_cannot_load_is_one_line(checkpoints, tmp_path):
    """The fixture's blocks are cut at its tensors' edges (40 rows in blocks of 16), which transformers' FP8
    dequantization refuses: verify names the checkpoint and transformers in one line, no traceback."""
    fp8, _ = checkpoints
    convert_hf_to_mcore(fp8, tmp_path / "mcore")
    result = run_cli("verify", "--hf", fp8, "--mcore", tmp_path / "mcore", "--device", "cpu")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("mconvert verify: error:")]
    assert f"{fp8}: transformers " in line and "cannot load it as the reference" in line


def test_random_fp8_checkpoints_are_the_hubs_layout(tmp_path):
    """What the conversion benchmark reads as a DeepSeek-V3 FP8 source: written tensor by tensor in the hub's
    layout (FP8 weights and their block scales, the quantization_config kept), converting as its dequantized
    values."""
    config = {**shrink(real_config("deepseek-v3")), "torch_dtype": "bfloat16",
              "quantization_config": {**real_config("deepseek-v3")["quantization_config"], "weight_block_size": list(BLOCK)}}
    hf = write_random_hf_checkpoint(config, tmp_path / "hf", quantized=True)
    assert json.loads((hf / "config.json").read_text())["quantization_config"]["weight_block_size"] == list(BLOCK)
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert tensors[name].dtype == torch.float8_e4m3fn and tensors[name + "_scale_inv"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    convert_hf_to_mcore(hf, tmp_path / "mcore", dtype=torch.float32)
    converted = stored(tmp_path / "mcore")["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"][3]
    assert torch.equal(converted, dequantize(tensors[name], tensors[name + "_scale_inv"]))


def test_the_export_writes_no_quantization_config(checkpoints, tmp_path, capsys):
    fp8, _ = checkpoints
    assert main(["hf-to-mcore", "--load-dir", str(fp8), "--save-dir", str(tmp_path / "mcore"), "--dtype", "bf16"]) == 0
    capsys.readouterr()
    assert main(["mcore-to-hf", "--load-dir", str(tmp_path / "mcore"), "--save-dir", str(tmp_path / "back"), "--hf-config", str(fp8)]) == 0
    assert f"wrote the weights unquantized: config.json leaves out the quantization_config of {fp8}" in capsys.readouterr().out
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


def test_fp8_without_block_scales_is_refused(checkpoints, tmp_path, capsys):
    fp8, _ = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(fp8 / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((fp8 / "config.json").read_text())
    assert main(["hf-to-mcore", "--load-dir", str(broken), "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "model.layers.1.self_attn.o_proj.weight" in err and "FP8 without" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_ue8m0_block_scales_convert_as_their_values(tmp_path):
    """DeepSeek-V3.2's `scale_fmt: ue8m0`: power-of-two block scales, stored here as float8_e8m0fnu (safetensors'
    F8_E8M0), convert as the same weights with the scales in fp32."""
    source = make_hf_checkpoint(shrink(real_config("deepseek-v3.2")), tmp_path / "source")
    tensors = load_file(source / "model.safetensors")
    quantized = {name: quantize(t, power_of_two=True) for name, t in tensors.items() if is_fp8_on_the_hub(name)}
    config = {**json.loads((source / "config.json").read_text()),
              "quantization_config": {**real_config("deepseek-v3.2")["quantization_config"], "weight_block_size": list(BLOCK)}}
    for name, scale_dtype in (("e8m0", torch.float8_e8m0fnu), ("fp32", torch.float32)):
        directory = tmp_path / name
        directory.mkdir()
        content = dict(tensors)
        for weight, (q, scale_inv) in quantized.items():
            content[weight], content[weight + "_scale_inv"] = q, scale_inv.to(scale_dtype)
        save_file(content, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config))
        convert_hf_to_mcore(directory, tmp_path / f"{name}-mcore", dtype=torch.float32)
    from_e8m0, from_fp32 = stored(tmp_path / "e8m0-mcore"), stored(tmp_path / "fp32-mcore")
    assert load_file(tmp_path / "e8m0" / "model.safetensors")["model.layers.1.self_attn.o_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    assert from_e8m0.keys() == from_fp32.keys() and all(torch.equal(from_e8m0[k], from_fp32[k]) for k in from_fp32)


def test_qwen35_moe_fp8_converts_as_its_dequantized_values(tmp_path):
    """Qwen3.5's FP8 checkpoints: block-quantized weights with their `_scale_inv` as DeepSeek-V3's, among them the
    fused 3-D experts (one grid of scales per expert) and the delta-net's fused in_proj_qkv, whose sections are cut
    from the dequantized tensor. Converted, they equal the conversion of the same weights dequantized by this test."""
    from mconvert.mcore.checkpoint import iteration_dir

    source = make_hf_checkpoint(shrink(real_config("qwen3.5-35b-a3b"), layers=4), tmp_path / "source", fused_experts=True)
    tensors = load_file(source / "model.safetensors")
    fp8_tensors, plain_tensors = dict(tensors), dict(tensors)
    quantized = 0
    for name, tensor in tensors.items():
        if not name.startswith("model.language_model.") or tensor.dim() < 2 or "norm" in name or "embed" in name or name.endswith("mlp.gate.weight"):
            continue
        pairs = [quantize(matrix) for matrix in tensor.reshape(-1, *tensor.shape[-2:])]
        q = torch.stack([p[0] for p in pairs]).reshape(tensor.shape)
        scale_inv = torch.stack([p[1] for p in pairs]).reshape(*tensor.shape[:-2], *pairs[0][1].shape)
        fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, scale_inv
        plain_tensors[name] = torch.stack([dequantize(*p) for p in pairs]).reshape(tensor.shape)
        quantized += 1
    assert quantized > 20 and any("experts.gate_up_proj" in name for name in fp8_tensors if name.endswith("_scale_inv"))
    config = json.loads((source / "config.json").read_text())
    fp8_config = {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}}
    for name, content, written in (("fp8", fp8_tensors, fp8_config), ("plain", plain_tensors, config)):
        (tmp_path / name).mkdir()
        save_file(content, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps(written))
        convert_hf_to_mcore(tmp_path / name, tmp_path / f"{name}-mcore", parallelism=Parallelism(tp=2, ep=2), dtype=torch.float32)
    stores = [DCPCheckpoint(iteration_dir(tmp_path / f"{name}-mcore")) for name in ("fp8", "plain")]
    assert sorted(stores[0].shapes) == sorted(stores[1].shapes)
    for key, shape in stores[1].shapes.items():
        assert torch.equal(*(as_torch(store.read_region(key, (0,) * len(shape), shape)) for store in stores)), key
