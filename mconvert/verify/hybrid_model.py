"""megatron-core's HybridModel (0.19 and later) on CPU ranks: its stack spec made from the local modules GPTModel's
CPU checks use, since megatron-core builds HybridModel's default stack (hybrid_stack_spec) from Transformer Engine
modules only. Each hybrid layer is the matching half of a local GPT layer, keyed as the Transformer Engine stack
keys it: the attention layers (`*`, `+`, `G`, `D`) keep the GPT layer's attention and its input norm, the MLP
layers (`-`, `E`) its MLP and the norm before it; the Mamba layers (`M`) are megatron-core's own MambaLayer with
local projections (mconvert.verify.mamba)."""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util

import torch

from mconvert.megatron_lm import layer_specs, spec_names
from mconvert.verify import cpu_shims, mamba


def _without_mlp(layer: object) -> object:
    """A local GPT layer spec with its MLP and the norm before it taken out: a hybrid attention layer."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    layer = copy.deepcopy(layer)
    layer.submodules.pre_mlp_layernorm = IdentityOp
    layer.submodules.mlp = IdentityOp
    layer.submodules.mlp_bda = IdentityFuncOp
    return layer


def _mlp_layer(layer: object, module: type, norm: type, keys_map: dict[str, str]) -> object:
    """The MLP half of a local GPT layer spec as a hybrid layer of `module` (MLPLayer, MoETransformerLayer)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    return ModuleSpec(
        module=module,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=copy.deepcopy(layer.submodules.mlp), mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def local_hybrid_stack_spec(config: object, args: argparse.Namespace) -> object:
    """HybridModel's stack spec from local modules, for CPU ranks, with `config`'s norms (zero-centred where it
    says). HybridStack builds its final norm as Transformer Engine's, which on CPU becomes that norm too."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    if getattr(config, "sequence_parallel", False):
        norm = cpu_shims.norm_under_sequence_parallelism()
    else:
        norm = layer_specs.RMSNorm
    hybrid_block.TENorm = norm
    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=args.normalization)
    mla = get_gpt_layer_local_spec(qk_layernorm=True, normalization=args.normalization, multi_latent_attention=True)
    moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts or 1, moe_grouped_gemm=False, normalization=args.normalization)
    for layer in (dense, mla, moe):
        layer.submodules.input_layernorm = norm
        attention = layer.submodules.self_attention.submodules
        for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            if getattr(attention, name, None) not in (None, IdentityOp):
                setattr(attention, name, norm)
    cpu_shims.mla_without_transformer_engine()
    mla.submodules.self_attention.submodules.core_attention = cpu_shims.local_mla_core_attention()
    submodules = HybridStackSubmodules(
        attention_layer=_without_mlp(dense),
        mla_layer=_without_mlp(mla),
        mlp_layer=_mlp_layer(dense, MLPLayer, norm, {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}),
        moe_layer=_mlp_layer(moe, MoETransformerLayer, norm, {}),
        mtp_block_spec=ModuleSpec(
            module=MultiTokenPredictionBlock,
            submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[ModuleSpec(
                module=MultiTokenPredictionLayer,
                submodules=MultiTokenPredictionLayerSubmodules(
                    enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm
                ),
            )]),
        ),
    )
    if config.mamba_num_heads:
        config.use_mamba_mem_eff_path = False  # the fused kernel is Triton; the other path runs the PyTorch references
        submodules.mamba_layer = mamba.local_mamba_layer(norm)
    if config.moe_latent_size:
        cpu_shims.moe_latent_projections_without_te()
    if config.experimental_attention_variant == "gated_delta_net":
        config.deterministic_mode = True  # GatedDeltaNet's PyTorch delta rule (cpu_shims.gated_delta_net_without_fla)
        submodules.gdn_layer = cpu_shims.local_gated_delta_net_layer(dense, norm)
    if config.experimental_attention_variant == "dsa":
        submodules.dsa_layer = cpu_shims.local_sparse_attention_layer(_without_mlp(mla), config, norm)
    return ModuleSpec(module=HybridStack, submodules=submodules)


def with_mconverts_layers(stack: object, args: argparse.Namespace) -> None:
    """The local stack spec with what the stack spec `args.spec` names (mconvert's, Transformer Engine's) has in place
    of HybridModel's default: mconvert's q/k norms across heads, or OLMo 2's norms after the sublayers."""
    layers = stack.submodules
    if tuple(args.spec or ()) == spec_names.QK_NORM_ACROSS_HEADS_HYBRID:
        layer_specs.with_qk_norm_across_heads(layers.attention_layer)
    elif tuple(args.spec or ()) == spec_names.NORMS_AFTER_SUBLAYERS_HYBRID:
        for layer in (layers.attention_layer, layers.mlp_layer):
            layer_specs.with_norms_after_sublayers(layer, transformer_engine=False)


def build_model_as_pretrain_hybrid(args: argparse.Namespace, pre_process: bool, post_process: bool) -> object:
    """The HybridModel Megatron-LM's pretrain_hybrid.py builds from `args` (hybrid_config_from_args and its
    HybridModelBuilder), with the local stack spec in place of its Transformer Engine one on CPU ranks."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import hybrid_config_from_args
    from megatron.training.models.hybrid import HybridModelBuilder

    model_config = hybrid_config_from_args(args)
    if args.transformer_impl != "transformer_engine":
        model_config.hybrid_stack_spec = local_hybrid_stack_spec(model_config.transformer, args)
        with_mconverts_layers(model_config.hybrid_stack_spec, args)
    return HybridModelBuilder(model_config).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=pre_process, post_process=post_process
    )


def build_hybrid_model(
    args: argparse.Namespace, params_dtype: torch.dtype, pre_process: bool, post_process: bool, transformer_impl: str,
    perform_initialization: bool = True,
) -> object:
    """This rank's HybridModel from a hybrid checkpoint's args with megatron-core alone (verify's reference), its stages
    as `args.hybrid_layer_pattern`'s `|` place them: the Transformer Engine stack its `--spec` names, or the local
    stack on CPU ranks."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mconvert.verify.megatron_model import (
        language_model_settings,
        transformer_config_from_args,
        uses_transformer_engine,
        yarn_settings,
    )

    config = transformer_config_from_args(args, params_dtype, transformer_impl, perform_initialization)
    yarn_settings(config, args)
    if uses_transformer_engine(transformer_impl):
        module, name = args.spec
        stack = getattr(importlib.import_module(module), name)
        if config.mamba_num_heads and importlib.util.find_spec("causal_conv1d") is None:
            # The fused Mamba path calls causal_conv1d's CUDA kernels; megatron-core's other path (a plain conv1d, the
            # same chunked scan) computes the same function without them.
            config.use_mamba_mem_eff_path = False
    else:
        stack = local_hybrid_stack_spec(config, args)
        with_mconverts_layers(stack, args)
    return HybridModel(
        hybrid_stack_spec=stack, hybrid_layer_pattern=args.hybrid_layer_pattern,
        **language_model_settings(config, args, pre_process, post_process),
    )
