"""The MXFP4 export's quantizer (mconvert.formats.quantized.quantize_mxfp4, numpy on the CPU) held bit for bit to the
quantizers gpt-oss's MXFP4 comes from, on a GPU: triton_kernels' Triton kernel `downcast_to_mxfp` (what gpt-oss's
reference `quantize_mx4` calls) and transformers' `quantize_to_mxfp4` (its torch twin `downcast_to_mxfp_torch`, here
on the GPU), both with their default rounding of the scales (up). The CPU suite holds it to torchao's
(tests/test_mxfp4_export.py); triton_kernels is no package of the index: it is the triton repository's
python/triton_kernels, which transformers fetches from the hub.

    MCONVERT_TRITON_KERNELS=/path/to/triton/python/triton_kernels python -m pytest -m gpu tests/gpu/test_mxfp4_quantizer.py

(or with triton_kernels importable as installed). Older copies of triton_kernels (those of gpt-oss's release time, and
the copies other projects carry of them) round a value halfway between two e2m1 values away from zero ("tie breaking
up"), where the current one and torchao round it to even, as this export does: against such a copy this test fails
on the groups holding a tie (the count says how many), and nowhere else. The weights: gpt-oss-20b's expert shapes in transformers' layout,
[E, in, out], cut to 4 experts, at about 0.1 and at scales from 1e-6 to 1e3, with groups of zeros and values that fall
on every tie between two e2m1 values."""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

# gpt-oss-20b's experts, [E, in, out]: gate_up_proj [E, 2880, 5760] and down_proj [E, 2880, 2880], 4 of their 32.
SHAPES = {"gate_up_proj": (4, 2880, 5760), "down_proj": (4, 2880, 2880)}
# Scaled values on the ties between neighbouring e2m1 values (and past 6, which saturates).
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0)


def triton_kernels():
    """triton_kernels as installed, or from the folder MCONVERT_TRITON_KERNELS names; skipped where neither is."""
    folder = os.environ.get("MCONVERT_TRITON_KERNELS")
    if folder:
        sys.path.insert(0, folder)
    module = pytest.importorskip(
        "triton_kernels", reason="triton_kernels (the triton repository's python/triton_kernels): install it or name it in MCONVERT_TRITON_KERNELS"
    )
    import triton_kernels.numerics_details.mxfp  # noqa: F401 (transformers reaches it as an attribute)

    return module


def weights(shape, generator):
    """bf16 weights of `shape` [E, in, out] on the GPU: normal at about 0.1 times 10^k, k from -6 to 3 by output, a
    group of zeros in each expert, and groups whose amax is 6 x 2^j with values on the ties."""
    import torch

    experts, _, outputs = shape
    values = torch.randn(shape, generator=generator) * 0.1
    values *= 10.0 ** torch.arange(-6, 4).repeat(-(-outputs // 10))[:outputs].float()
    values[:, :32, 0] = 0
    for expert in range(experts):
        scale = 2.0 ** (expert - 2)
        values[expert, 32:64, 1] = torch.tensor(TIES * 2) * scale
    return values.to(torch.bfloat16).cuda()


def test_quantize_mxfp4_is_triton_kernels_quantizer_bit_for_bit():
    import numpy as np
    import torch
    from transformers.integrations.mxfp4 import quantize_to_mxfp4

    from mconvert.formats.quantized import quantize_mxfp4

    kernels = triton_kernels()
    generator = torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        w = weights(shape, generator)
        blocks, scales = quantize_mxfp4(w.float().cpu().numpy().swapaxes(-1, -2))
        blocks = blocks.reshape(*blocks.shape[:-2], -1)  # [E, out, in / 2]
        triton_values, triton_scales = kernels.numerics_details.mxfp.downcast_to_mxfp(w, torch.uint8, axis=1)
        twin_values, twin_scales = quantize_to_mxfp4(w, kernels)
        for who, values, exponents in (("downcast_to_mxfp", triton_values, triton_scales), ("quantize_to_mxfp4", twin_values, twin_scales)):
            values = values.transpose(1, 2).contiguous().cpu().numpy()  # [E, in / 2, out] -> gpt-oss's [E, out, in / 2]
            exponents = exponents.transpose(1, 2).contiguous().cpu().numpy()
            assert values.shape == blocks.shape and exponents.shape == scales.shape, (who, name, values.shape, exponents.shape)
            assert np.array_equal(exponents, scales), f"{who} {name}: {np.count_nonzero(exponents != scales)} exponents differ"
            assert np.array_equal(values, blocks), f"{who} {name}: {np.count_nonzero(values != blocks)} bytes differ"
