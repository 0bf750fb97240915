"""Megatron-LM's `--spec MODULE OBJECT` for HybridModel runs of models with q/k norms over all heads of a layer
(MiniMax-M2): its builder takes the object as the stack spec, so it is made when this module is imported, which
imports megatron-core (only Megatron-LM imports this module). HybridModel's default (Transformer Engine) stack
spec, its attention layers' q/k norms those of mconvert.megatron_lm.layer_specs."""

from __future__ import annotations

import copy

from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

from mconvert.megatron_lm.layer_specs import with_qk_norm_across_heads


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


hybrid_stack_with_qk_norm_across_heads = _copied_down_to_the_attention(hybrid_stack_spec)
with_qk_norm_across_heads(hybrid_stack_with_qk_norm_across_heads.submodules.attention_layer)
