"""Megatron-LM's args.spec for mconvert's own layer specs (mconvert.megatron_lm.layer_specs says what they are), as
its --spec flag takes and its checkpoints store them: GPTModel's (a function its builder calls) and HybridModel's (a
stack spec its builder takes as it is). Named here, apart from their modules, which import torch and megatron-core:
writing a checkpoint's args needs only the names."""

QK_NORM_ACROSS_HEADS = ("mconvert.megatron_lm.layer_specs", "gpt_layers_with_qk_norm_across_heads")
QK_NORM_ACROSS_HEADS_HYBRID = ("mconvert.megatron_lm.hybrid_layer_specs", "hybrid_stack_with_qk_norm_across_heads")
# OLMo 2's layers: norms after the attention and the MLP, none before them, and q/k norms across heads.
NORMS_AFTER_SUBLAYERS = ("mconvert.megatron_lm.layer_specs", "gpt_layers_with_norms_after_sublayers")
NORMS_AFTER_SUBLAYERS_HYBRID = ("mconvert.megatron_lm.hybrid_layer_specs", "hybrid_stack_with_norms_after_sublayers")
# Gemma 3's layers: norms before and after the attention and the MLP, a GeGLU with GELU's tanh approximation, and on
# the sliding-window layers a rope of their own, of theta GEMMA3_SLIDING_WINDOW_ROPE_THETA unscaled (every Gemma 3
# release's rope_local_base_freq: a layer spec takes no value from Megatron-LM's command line).
GEMMA3_LAYERS = ("mconvert.megatron_lm.layer_specs", "gpt_layers_of_gemma3")
GEMMA3_SLIDING_WINDOW_ROPE_THETA = 10000.0
# HybridModel's stack spec for each of GPTModel's layer specs above that has one.
HYBRID_STACKS = {QK_NORM_ACROSS_HEADS: QK_NORM_ACROSS_HEADS_HYBRID, NORMS_AFTER_SUBLAYERS: NORMS_AFTER_SUBLAYERS_HYBRID}
# Every layer spec of mconvert's, GPTModel's and HybridModel's.
MCONVERT_SPECS = frozenset({*HYBRID_STACKS, *HYBRID_STACKS.values(), GEMMA3_LAYERS})
