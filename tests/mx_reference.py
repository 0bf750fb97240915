"""The reference MXFP4 quantizer, torchao's, run in a process of its own: `python tests/mx_reference.py IN OUT` writes,
for each tensor of the safetensors file IN (transformers' gpt-oss experts, [E, in, out]), its MXFP4 in gpt-oss's layout
into OUT: `X_blocks` [E, out, in / 32, 16] and `X_scales` [E, out, in / 32].

torchao's `to_mx` to float4_e2m1fn_x2, groups of 32, the scale rounded up (ScaleCalculationMode.RCEIL: 2^ceil(log2(amax
/ 6))), each value rounded to the nearest e2m1, ties to even, packed two a byte, the first in the low 4 bits; given the
experts in bf16, as gpt-oss's and transformers' callers of triton_kernels' quantizer give them (tests/test_mxfp4_export.py
says why this is that quantizer's arithmetic). torchao is installed in a folder of its own (scripts/install.sh), on
this process's path alone: where transformers finds torchao, it imports it with every model it loads (a second, and
lines on stderr)."""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file, save_file
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = weight.transpose(-1, -2).to(torch.bfloat16).contiguous()
    scales, data = to_mx(rows, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL)
    return data.view(torch.uint8).reshape(*rows.shape[:-1], -1, 16).contiguous(), scales.view(torch.uint8).contiguous()


if __name__ == "__main__":
    source, target = sys.argv[1:]
    out = {}
    for name, weight in load_file(source).items():
        out[name + "_blocks"], out[name + "_scales"] = quantized(weight)
    save_file(out, target)
