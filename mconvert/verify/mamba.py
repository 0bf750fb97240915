"""megatron-core's Mamba-2 layers (MambaMixer, HybridModel's `M`) on CPU ranks.

MambaMixer refuses to build without `mamba_ssm` and `einops`. The package index has mamba_ssm only as a source
distribution, built without its CUDA extension here (scripts/install312.sh); its import then asks for that extension,
`selective_scan_cuda`, which megatron-core never calls: a stand-in module lets it import. What megatron-core does call
of it is Triton, which cannot run on CPU: the chunked scan and the gated RMSNorm, replaced by mamba_ssm's own PyTorch
references (ssd_chunk_scan_combined_ref, rms_norm_ref) on the path without the fused kernel
(`use_mamba_mem_eff_path` off); the convolution is a plain conv1d where `causal_conv1d` is absent. Install these only
in processes that run megatron-core on CPU."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import torch


def _no_cuda_extension(name: str) -> object:
    raise AttributeError(f"selective_scan_cuda.{name}: mamba_ssm was built without its CUDA extension")


def mamba_ssm_importable() -> None:
    """A stand-in for mamba_ssm's CUDA extension where the package was built without it. Idempotent."""
    if importlib.util.find_spec("mamba_ssm") is None or "selective_scan_cuda" in sys.modules:
        return
    if importlib.util.find_spec("selective_scan_cuda") is None:
        stand_in = types.ModuleType("selective_scan_cuda")
        stand_in.__getattr__ = _no_cuda_extension
        sys.modules["selective_scan_cuda"] = stand_in


def _chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, return_final_states=False,
                initial_states=None, **kwargs):
    """mamba_chunk_scan_combined as megatron-core calls it over a whole prompt (no states in or out), by mamba_ssm's
    PyTorch reference, over the prompt padded with zeros to whole chunks (which the causal scan leaves the prompt's
    outputs unchanged by)."""
    from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref

    if return_final_states or initial_states is not None:
        raise NotImplementedError("the CPU reference of mamba_chunk_scan_combined scans whole prompts only")
    length = x.shape[1]
    pad = -length % chunk_size

    def padded(t):
        return None if t is None else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))

    out = ssd_chunk_scan_combined_ref(
        padded(x), padded(dt), A, padded(B), padded(C), chunk_size, D=D, z=padded(z), dt_bias=dt_bias, dt_softplus=dt_softplus
    )
    return out[:, :length].to(x.dtype)


def _gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref

    return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size, norm_before_gate=self.norm_before_gate)


def mamba_mixer_on_cpu() -> None:
    """megatron-core's MambaMixer with the PyTorch references in place of its Triton kernels. Idempotent."""
    mamba_ssm_importable()
    from megatron.core.ssm import mamba_mixer

    if not mamba_mixer.HAVE_MAMBA_SSM:  # imported before the stand-in (Megatron-LM's import of its models): again
        importlib.reload(mamba_mixer)
    mamba_mixer.mamba_chunk_scan_combined = _chunk_scan
    mamba_mixer.ExtendedRMSNorm.forward = _gated_rms_norm


def local_mamba_layer(norm: type) -> object:
    """HybridModel's Mamba layer (`M`) from local modules: the layer's norm `norm`, a module of its own, stored under
    the key of the Transformer Engine in_proj it is fused into; local in and out projections."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    mamba_mixer_on_cpu()
    return ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
        ),
    )
