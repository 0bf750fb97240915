"""Megatron-LM's `--spec MODULE OBJECT` for HybridModel runs of models whose layers need modules of mconvert's
(mconvert.megatron_lm.layer_specs): its builder takes the object as the stack spec, so each is made when this module
is imported, which imports megatron-core (only Megatron-LM imports this module). HybridModel's default (Transformer
Engine) stack spec, its attention layers' q/k norms those of mconvert.megatron_lm.layer_specs (MiniMax-M2); or its
attention and MLP layers OLMo 2's halves, each sublayer's norm after it."""

from __future__ import annotations

import copy
import functools

from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

from mconvert.megatron_lm.layer_specs import with_norms_after_sublayers, with_qk_norm_across_heads


def _copied_down_to_the_attention(stack: object) -> object:
    """`stack` copied along the path to its attention layer's attention submodules (the rest shared: megatron-core's
    specs hold closures that do not deep-copy)."""
    stack = copy.copy(stack)
    stack.submodules = copy.copy(stack.submodules)
    layer = stack.submodules.attention_layer = copy.copy(stack.submodules.attention_layer)
    layer.submodules = copy.copy(layer.submodules)
    attention = layer.submodules.self_attention = copy.copy(layer.submodules.self_attention)
    attention.submodules = copy.copy(attention.submodules)
    return stack


def _copied_down_to_the_mlp(stack: object) -> object:
    """`stack` (a copy of its own down to the attention) copied along the path to its MLP layer's MLP submodules."""
    layer = stack.submodules.mlp_layer = copy.copy(stack.submodules.mlp_layer)
    layer.submodules = copy.copy(layer.submodules)
    mlp = layer.submodules.mlp
    layer.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": copy.copy(mlp.keywords["submodules"])})
    return stack


hybrid_stack_with_qk_norm_across_heads = _copied_down_to_the_attention(hybrid_stack_spec)
with_qk_norm_across_heads(hybrid_stack_with_qk_norm_across_heads.submodules.attention_layer)

hybrid_stack_with_norms_after_sublayers = _copied_down_to_the_mlp(_copied_down_to_the_attention(hybrid_stack_spec))
for _layer in (hybrid_stack_with_norms_after_sublayers.submodules.attention_layer, hybrid_stack_with_norms_after_sublayers.submodules.mlp_layer):
    with_norms_after_sublayers(_layer, transformer_engine=True)
