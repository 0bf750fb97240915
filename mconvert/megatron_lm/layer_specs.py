"""Layer specs for Megatron-LM's `--spec MODULE FUNCTION`, for models whose layers megatron-core builds only with a
module of mconvert's in its spec: q/k norms over all heads of a layer (MiniMax-M2's `qk_norm_type: per_layer`),
where megatron-core's own q/k norms span one head each.

    --qk-layernorm --spec mconvert.megatron_lm.layer_specs gpt_layers_with_qk_norm_across_heads
    --qk-layernorm --spec mconvert.megatron_lm.hybrid_layer_specs hybrid_stack_with_qk_norm_across_heads  # HybridModel

Megatron-LM's GPT model builder calls the function with its model config in place of its default layer spec; the
function takes that default and puts `QueryNormAcrossHeads` and `KeyNormAcrossHeads` where the per-head norms were;
Megatron-LM's HybridModel builder takes a stack spec object instead: HybridModel's default with those norms
(mconvert.megatron_lm.hybrid_layer_specs, which imports megatron-core).
The training environment needs mconvert importable (it needs nothing else of it). Megatron-LM stores `--spec` in
its checkpoints' args and `--use-checkpoint-args` restores it. megatron-core is imported only when a spec is built.
"""

from __future__ import annotations

from typing import Any

import torch


class _SumOverRanks(torch.autograd.Function):
    """A sum over the ranks of `group` in the forward pass and in the backward pass: every rank's output depends on
    every rank's input, so every rank's input gradient sums every rank's output gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class RMSNormAcrossHeads(torch.nn.Module):
    """RMSNorm of the query (or key) of all `heads` heads of a layer together, as transformers' MiniMax-M2 computes
    it: in fp32, cast back, then scaled by the weight. megatron-core hands it this rank's heads, [s, b, heads/TP,
    head_dim]; the sum of squares is all-reduced over the tensor-parallel ranks in the forward and in the backward
    pass, so that each rank's gradient counts every rank's use of the shared denominator. The weight, one per
    channel of the layer's heads, is split across those ranks as the heads are."""

    def __init__(self, heads: int, head_dim: int, config: Any, eps: float):
        super().__init__()
        self.tp = config.tensor_model_parallel_size
        if heads % self.tp:
            raise ValueError(
                f"q/k norms across heads: tensor parallelism {self.tp} does not divide the {heads} heads they normalise"
            )
        self.width, self.eps = heads * head_dim, eps
        # Split, not replicated: each rank sees the whole sequence of its own heads (no sequence-parallel gradient sum).
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().flatten(-2)
        squares = self.sum_over_ranks(rows.pow(2).sum(-1, keepdim=True))
        normalised = rows * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normalised.to(x.dtype)).view_as(x)

    def sum_over_ranks(self, squares: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        return _SumOverRanks.apply(squares, parallel_state.get_tensor_model_parallel_group()) if self.tp > 1 else squares

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets)


class QueryNormAcrossHeads(RMSNormAcrossHeads):
    """The query's, built as megatron-core builds its q_layernorm (`hidden_size` is one head's)."""

    def __init__(self, hidden_size: int, config: Any, eps: float = 1e-5):
        super().__init__(config.num_attention_heads, hidden_size, config, eps)


class KeyNormAcrossHeads(RMSNormAcrossHeads):
    """The key's: over the query groups' key heads. At tensor parallelism above the query groups megatron-core gives
    each rank a whole group's key that other ranks share, which this norm does not split: refused."""

    def __init__(self, hidden_size: int, config: Any, eps: float = 1e-5):
        super().__init__(config.num_query_groups or config.num_attention_heads, hidden_size, config, eps)


def with_qk_norm_across_heads(spec: Any) -> Any:
    """`spec` (one layer's ModuleSpec or a TransformerBlockSubmodules of several) with its attention's q/k norms
    across heads."""
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = QueryNormAcrossHeads, KeyNormAcrossHeads
    return spec


def gpt_layers_with_qk_norm_across_heads(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron-LM's `--spec` function: its GPT model builder's default layer spec for `config` (a
    megatron.training.models.GPTModelConfig), with q/k norms across heads."""
    from megatron.training.models.gpt import default_layer_spec

    return with_qk_norm_across_heads(default_layer_spec(config, vp_stage))

