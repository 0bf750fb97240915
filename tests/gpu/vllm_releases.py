"""Quantized releases for tests/gpu/test_vllm.py, made as the hub stores them: of a shrunk Qwen3, FP8 in 128 x 128 blocks
(DeepSeek-V3's and Qwen3-FP8's format: float8_e4m3fn weights, an fp32 `weight_scale_inv` per block) and
compressed-tensors' pack-quantized INT4 (Kimi-K2-Thinking's: int32 words of eight 4-bit integers, a bf16 scale per group
of 32 columns, the weight's shape); of a shrunk gpt-oss, MXFP4 experts (gpt-oss's: `_blocks` of two e2m1 codes a byte,
32 to a group, and `_scales`, a uint8 exponent a group; attention, router, embeddings and output layer in bf16, as its
config's modules_to_not_convert says). The quantizers are mconvert's (mconvert.formats.quantized), which
tests/test_fp8_export.py, tests/test_int4_export.py and tests/test_mxfp4_export.py hold bit for bit to compressed-tensors'
and triton_kernels'. Wide enough for vLLM's kernels: every quantized input and output width a multiple of 128 (FP8
blocks, Marlin's INT4 tiles) and gpt-oss's 256 (Marlin's MXFP4 rounds the hidden size up to 256, Triton's the experts'
width to 64)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

# hidden 256, 4 query heads and 2 key-value heads of 64, MLP 512: q 256, k and v 128 wide.
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
# gpt-oss: hidden 256, 4 query heads and 2 key-value heads of 64, 8 experts of width 256; its window of 32 as gpu_cases'.
GPT_OSS_SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=64, sliding_window=32)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False,
                "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT4_WEIGHTS, "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
MXFP4 = real_config("gpt-oss-20b")["quantization_config"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantized_names(tensors: dict) -> list[str]:
    """The linear layers of attention and the MLP (not embeddings, norms or the output layer)."""
    return [name for name in tensors if name.endswith("proj.weight")]


def quantized_release(kind: str, source: Path, release: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from mconvert.formats.quantized import quantize_fp8_blocks, quantize_int4

    from mconvert.formats.quantized import MXFP4_BLOCKS, MXFP4_SCALES, quantize_mxfp4

    if kind == "mxfp4":
        make_hf_checkpoint(shrink(real_config("gpt-oss-20b"), layers=2, **GPT_OSS_SHAPE), source, dtype="bfloat16", weight_std=0.1)
    else:
        make_hf_checkpoint(shrink(real_config("qwen3-8b"), **SHAPE), source, dtype="bfloat16", weight_std=0.1)
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = (tensors["lm_head.weight"].float() * 5).to(torch.bfloat16)  # clear greedy choices
    out = dict(tensors)
    for name in (n for n in tensors if n.endswith(EXPERTS)) if kind == "mxfp4" else ():
        # [experts, inputs, outputs] in transformers' layout; the hub's blocks [experts, outputs, groups, 16].
        blocks, scales = quantize_mxfp4(tensors[name].float().numpy().swapaxes(-1, -2))
        del out[name]
        out[name + MXFP4_BLOCKS] = torch.from_numpy(np.ascontiguousarray(blocks))
        out[name + MXFP4_SCALES] = torch.from_numpy(np.ascontiguousarray(scales))
    for name in quantized_names(tensors) if kind != "mxfp4" else ():
        values = tensors[name].float().numpy()
        module = name.removesuffix(".weight")
        if kind == "fp8_block":
            weight, scales = quantize_fp8_blocks(values, tuple(FP8["weight_block_size"]))
            out[name] = torch.from_numpy(np.ascontiguousarray(weight).view(np.uint8)).view(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
        else:
            import ml_dtypes

            packed, scales = quantize_int4(values, INT4_WEIGHTS["group_size"], ml_dtypes.bfloat16)
            del out[name]
            out[f"{module}.weight_packed"] = torch.from_numpy(packed)
            out[f"{module}.weight_scale"] = torch.from_numpy(scales.view(np.uint16)).view(torch.bfloat16)
            out[f"{module}.weight_shape"] = torch.tensor(values.shape, dtype=torch.int64)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"fp8_block": FP8, "int4": INT4, "mxfp4": MXFP4}[kind]
    config["torch_dtype"] = "bfloat16"
    release.mkdir(parents=True)
    save_file(out, release / "model.safetensors", metadata={"format": "pt"})
    (release / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (source / extra).exists():
            shutil.copy(source / extra, release / extra)
    return release


def scales_doubled(export: Path, fault: Path) -> Path:
    """The export with layer 0's MLP down projection's scales doubled (MXFP4's exponents one up)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, fault)
    for path in fault.glob("*.safetensors"):
        tensors = load_file(path)
        names = [n for n in tensors if ".layers.0.mlp.down_proj.weight_scale" in n or n.endswith(".layers.0.mlp.experts.down_proj_scales")]
        for name in names:
            tensors[name] = tensors[name] + 1 if tensors[name].dtype == torch.uint8 else tensors[name] * 2
        if names:
            save_file(tensors, path, metadata={"format": "pt"})
    return fault
