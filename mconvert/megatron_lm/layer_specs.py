"""Layer specs for Megatron-LM's `--spec MODULE FUNCTION`, for models whose layers megatron-core builds only with
modules of mconvert's in its spec: q/k norms over all heads of a layer (MiniMax-M2's `qk_norm_type: per_layer`),
where megatron-core's own q/k norms span one head each; OLMo 2's layer, whose norms come after its attention
and its MLP (before each residual add) rather than before them, beside q/k norms across heads; and Gemma 3's layer,
with norms both before and after its attention and its MLP, a GeGLU with GELU's tanh approximation, and on its
sliding-window layers a rope of their own.

    --qk-layernorm --spec mconvert.megatron_lm.layer_specs gpt_layers_with_qk_norm_across_heads
    --qk-layernorm --spec mconvert.megatron_lm.layer_specs gpt_layers_with_norms_after_sublayers
    --qk-layernorm --spec mconvert.megatron_lm.layer_specs gpt_layers_of_gemma3
    --qk-layernorm --spec mconvert.megatron_lm.hybrid_layer_specs hybrid_stack_with_qk_norm_across_heads  # HybridModel
    --qk-layernorm --spec mconvert.megatron_lm.hybrid_layer_specs hybrid_stack_with_norms_after_sublayers

Megatron-LM's GPT model builder calls the function with its model config in place of its default layer spec; the
function takes that default and puts `QueryNormAcrossHeads` and `KeyNormAcrossHeads` where the per-head norms were
(and, for OLMo 2, moves the norms: `with_norms_after_sublayers`; for Gemma 3, adds norms after the sublayers, the
MLP's activation and the rope: `with_norms_around_sublayers`); Megatron-LM's HybridModel builder takes a stack spec
object instead: HybridModel's default with those changes (mconvert.megatron_lm.hybrid_layer_specs, which imports
megatron-core).
The training environment needs mconvert importable (it needs nothing else of it). Megatron-LM stores `--spec` in
its checkpoints' args and `--use-checkpoint-args` restores it. megatron-core is imported only when a spec is built.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

from mconvert.megatron_lm.spec_names import GEMMA3_SLIDING_WINDOW_ROPE_THETA


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


class RMSNorm(torch.nn.Module):
    """An RMSNorm for megatron-core's local layers (its `config, hidden_size, eps` interface) that is zero-centred
    (weight w, output scaled by 1 + w, as Transformer Engine's zero_centered_gamma) where the config says
    (`--apply-layernorm-1p`): the local spec's torch norm refuses zero-centred weights, and apex's fused norm is a
    LayerNorm. In fp32, cast back at the end, as transformers' Gemma and Qwen3-Next norms."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        super().__init__()
        self.eps, self.zero_centered = eps, config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size) if self.zero_centered else torch.ones(hidden_size))
        # Each tensor-parallel rank's gradient of a part of the sequence, summed over the ranks by megatron-core.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.weight.float() + 1 if self.zero_centered else self.weight.float())).to(x.dtype)


class RMSNormAcrossHeads(torch.nn.Module):
    """RMSNorm of the query (or key) of all `heads` heads of a layer together, as transformers' MiniMax-M2 computes
    it: in fp32, cast back, then scaled by the weight (OLMo 2's scales in fp32, then casts back: `scales_in_fp32`).
    megatron-core hands it this rank's heads, [s, b, heads/TP, head_dim]; the sum of squares is all-reduced over the
    tensor-parallel ranks in the forward and in the backward pass, so that each rank's gradient counts every rank's
    use of the shared denominator. The weight, one per channel of the layer's heads, is split across those ranks as
    the heads are."""

    scales_in_fp32 = False

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
        if self.scales_in_fp32:
            return (self.weight * normalised).to(x.dtype).view_as(x)
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


class QueryNormAcrossHeadsInFp32(QueryNormAcrossHeads):
    """OLMo 2's: the weight scales the fp32 values."""

    scales_in_fp32 = True


class KeyNormAcrossHeadsInFp32(KeyNormAcrossHeads):
    """OLMo 2's: the weight scales the fp32 values."""

    scales_in_fp32 = True


def _layers(spec: Any) -> list:
    """The layer specs of `spec`: one layer's ModuleSpec, or a TransformerBlockSubmodules of several."""
    return getattr(spec, "layer_specs", None) or [spec]


def with_qk_norm_across_heads(spec: Any) -> Any:
    """`spec` (one layer's ModuleSpec or a TransformerBlockSubmodules of several) with its attention's q/k norms
    across heads."""
    for layer in _layers(spec):
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = QueryNormAcrossHeads, KeyNormAcrossHeads
    return spec


@functools.cache
def normed_after(linear: type, norm: type) -> type:
    """`linear`, a row-parallel linear that ends a sublayer, with `norm` over its output, its bias added first: the
    sublayer's output normalised before the residual add. The output is whole on every tensor-parallel rank (a
    part of the sequence under sequence parallelism), so the norm is per token and its weight replicated; it is
    stored as the linear's `post_layernorm.weight` (the linear's sharded_state_dict holds it under both specs)."""

    class NormedAfter(linear):
        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = norm(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            output, bias = super().forward(x)
            return self.post_layernorm(output if bias is None else output + bias), None

    return NormedAfter


def _mlp_submodules(mlp: Any) -> Any:
    """A dense MLP's MLPSubmodules: its ModuleSpec's (megatron-core 0.16) or its builder's (0.19)."""
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def with_norms_after_sublayers(spec: Any, transformer_engine: bool) -> Any:
    """`spec` (as with_qk_norm_across_heads takes it; the dense layers of megatron-core's Transformer Engine spec, or
    of its local one) as OLMo 2's layers: no norm before the attention or the MLP (Transformer Engine's fused into
    linear_qkv and linear_fc1 taken out with them), an RMSNorm on the output of each (in linear_proj and linear_fc2:
    normed_after), q/k norms across heads scaled in fp32. A HybridModel's attention layer or MLP layer has one of
    the two sublayers."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.identity_op import IdentityOp

    if transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    for layer in _layers(spec):
        layer = layer.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = IdentityOp
        if layer.self_attention is not IdentityOp:
            attention = layer.self_attention.submodules
            attention.linear_qkv = backend.column_parallel_linear()
            attention.linear_proj = normed_after(attention.linear_proj, norm)
            attention.q_layernorm, attention.k_layernorm = QueryNormAcrossHeadsInFp32, KeyNormAcrossHeadsInFp32
        if layer.mlp is not IdentityOp:
            mlp = _mlp_submodules(layer.mlp)
            mlp.linear_fc1 = backend.column_parallel_linear()
            mlp.linear_fc2 = normed_after(mlp.linear_fc2, norm)
    return spec


def gpt_layers_with_qk_norm_across_heads(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron-LM's `--spec` function: its GPT model builder's default layer spec for `config` (a
    megatron.training.models.GPTModelConfig), with q/k norms across heads."""
    from megatron.training.models.gpt import default_layer_spec

    return with_qk_norm_across_heads(default_layer_spec(config, vp_stage))


def gpt_layers_with_norms_after_sublayers(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron-LM's `--spec` function: its GPT model builder's default layer spec for `config`, as OLMo 2's layers
    (with_norms_after_sublayers)."""
    from megatron.training.models.gpt import default_layer_spec

    transformer_engine = config.transformer.transformer_impl == "transformer_engine"
    return with_norms_after_sublayers(default_layer_spec(config, vp_stage), transformer_engine)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, as transformers' gelu_pytorch_tanh (torch's own)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


@functools.cache
def gated_by_tanh_gelu(mlp: type) -> type:
    """`mlp` (megatron-core's MLP) as a GeGLU with GELU's tanh approximation (Gemma's), which no Megatron-LM flag
    chooses (its --swiglu and --quick-geglu are other gates): built with a copy of the config that says so, unfused."""

    class GeGLU(mlp):
        def __init__(self, config: Any, *args: Any, **kwargs: Any):
            config = copy.copy(config)
            config.gated_linear_unit, config.activation_func = True, gelu_tanh
            config.bias_activation_fusion = config.use_te_activation_func = False
            super().__init__(config, *args, **kwargs)

    return GeGLU


@functools.cache
def with_sliding_window_rope(attention: type) -> type:
    """`attention` (megatron-core's SelfAttention) whose sliding-window layers (megatron-core's window_size and
    window_attn_skip_freq say which) rotate with a rope of their own, of theta `sliding_window_rope_theta`, unscaled.

    megatron-core has one rope a model: GPTModel hands every layer the angles of its RotaryEmbedding, [s, 1, 1, d], a
    row for each position the rank's tokens hold (an inference offset, a context-parallel rank's chunks, the rows of
    packed sequences). Their first column is the position itself (the first frequency is 1), divided by the linear
    interpolation factor (`rope_interpolation`, GPTModel's seq_len_interpolation_factor): these layers take those
    positions, times their own frequencies (RotaryEmbedding's formula), in the same layout. The inference caches of
    cosines and sines (flash decode, flashinfer's fused rope) hold GPTModel's rope only: refused on these layers."""

    class SlidingWindowRope(attention):
        def __init__(self, *args: Any, sliding_window_rope_theta: float, rope_interpolation: float | None, **kwargs: Any):
            from megatron.core.transformer.utils import is_layer_window_attention

            super().__init__(*args, **kwargs)
            windowed = is_layer_window_attention(self.config.window_size, self.config.window_attn_skip_freq, self.layer_number)
            self.sliding_window_rope_theta = sliding_window_rope_theta if windowed else None
            self.rope_interpolation = rope_interpolation or 1.0

        def forward(self, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any) -> Any:
            if self.sliding_window_rope_theta is not None:
                if kwargs.get("rotary_pos_cos") is not None or kwargs.get("rotary_pos_cos_sin") is not None:
                    raise NotImplementedError("mconvert's sliding-window rope: inference's cached cosines and sines are GPTModel's rope only")
                if isinstance(rotary_pos_emb, tuple):
                    rotary_pos_emb = tuple(map(self.own_rope, rotary_pos_emb))
                elif rotary_pos_emb is not None:
                    rotary_pos_emb = self.own_rope(rotary_pos_emb)
            return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)

        def own_rope(self, angles: torch.Tensor) -> torch.Tensor:
            positions = (angles[:, 0, 0, 0] * self.rope_interpolation).round()
            dim = angles.shape[-1]
            inv_freq = 1.0 / (self.sliding_window_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=angles.device) / dim))
            freqs = torch.outer(positions, inv_freq)
            pairs = torch.stack((freqs, freqs), -1) if self.config.rotary_interleaved else torch.cat((freqs, freqs), -1)
            return pairs.reshape(len(freqs), dim)[:, None, None, :]

    return SlidingWindowRope


def with_norms_around_sublayers(
    spec: Any, config: Any, transformer_engine: bool, rope_interpolation: float | None = None, vp_stage: int | None = None,
) -> Any:
    """Gemma 3's layers from `spec`, one dense layer's ModuleSpec of megatron-core's Transformer Engine spec or its
    local one, for `config` (a TransformerConfig): its norms before the attention and the MLP kept, an RMSNorm on each
    one's output (in linear_proj and linear_fc2: normed_after), its MLP a GeGLU with GELU's tanh approximation, its
    sliding-window layers with their own rope (with_sliding_window_rope, of GEMMA3_SLIDING_WINDOW_ROPE_THETA); under
    the local spec every norm mconvert's RMSNorm, zero-centred where the config says (megatron-core's local norms
    cannot be). A block of this pipeline stage's layers, with its final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        norm = TESpecProvider().layer_norm(rms_norm=True, for_qk=False)
    else:
        norm = RMSNorm
    layer = spec.submodules
    attention = layer.self_attention.submodules
    if not transformer_engine:
        layer.input_layernorm = layer.pre_mlp_layernorm = attention.q_layernorm = attention.k_layernorm = norm
    attention.linear_proj = normed_after(attention.linear_proj, norm)
    layer.self_attention.module = with_sliding_window_rope(layer.self_attention.module)
    layer.self_attention.params = {
        **layer.self_attention.params, "sliding_window_rope_theta": GEMMA3_SLIDING_WINDOW_ROPE_THETA, "rope_interpolation": rope_interpolation,
    }
    mlp = _mlp_submodules(layer.mlp)
    mlp.linear_fc2 = normed_after(mlp.linear_fc2, norm)
    layer.mlp = _with_mlp_class(layer.mlp, gated_by_tanh_gelu)
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage), layer_norm=norm)


def _with_mlp_class(mlp: Any, make: Any) -> Any:
    """A dense MLP's spec (megatron-core 0.16's ModuleSpec, 0.19's builder: the class's as_mlp_submodule) with its
    class `make(class)`."""
    if hasattr(mlp, "submodules"):
        return dataclasses.replace(mlp, module=make(mlp.module))
    return functools.partial(make(mlp.func.__self__).as_mlp_submodule, *mlp.args, **mlp.keywords)


def gpt_layers_of_gemma3(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron-LM's `--spec` function: Gemma 3's layers (with_norms_around_sublayers) from its GPT model builder's
    default layer spec for `config`, the interpolation factor GPTModel's rope gets from the same config."""
    from megatron.training.models.gpt import default_layer_spec

    transformer_engine = config.transformer.transformer_impl == "transformer_engine"
    return with_norms_around_sublayers(
        default_layer_spec(config, vp_stage), config.transformer, transformer_engine, config.seq_len_interpolation_factor, vp_stage,
    )
