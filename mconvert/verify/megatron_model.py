"""Build megatron-core's own GPTModel from a checkpoint's Megatron-LM `args`.

`args` is the `argparse.Namespace` Megatron-LM stores in `common.pt` (Megatron-LM's argument names, as
`--use-checkpoint-args` reads them). The parallel layout is not taken from `args` (that is the layout the
checkpoint was saved with) but from megatron-core's `parallel_state`, i.e. the layout of the ranks
that load it: torch_dist checkpoints are layout-independent.
"""

import argparse
import importlib.util
from typing import Literal

import megatron.core
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from packaging.version import Version

from mconvert.errors import ConversionError
from mconvert.mcore.parallelism import Parallelism, PipelineSplit, padded_vocab_size
from mconvert.megatron_lm import layer_specs, spec_names
from mconvert.megatron_lm.args import stored_arg
from mconvert.megatron_lm.flags import unnormalized_mla_query
from mconvert.verify import cpu_shims
from mconvert.verify.mamba import mamba_settings

try:
    import transformer_engine  # noqa: F401  (only probing whether it is installed)

    HAVE_TRANSFORMER_ENGINE = True
except ImportError:
    HAVE_TRANSFORMER_ENGINE = False

TransformerImpl = Literal["transformer_engine", "local"]



def uses_transformer_engine(transformer_impl: TransformerImpl) -> bool:
    """The Transformer Engine spec is used when asked for and installed; the local spec otherwise."""
    return transformer_impl == "transformer_engine" and HAVE_TRANSFORMER_ENGINE


def padded_vocab_size_for_tp(args: argparse.Namespace, tp: int) -> int:
    """The embedding rows Megatron-LM uses at tensor-parallel size `tp`.

    Megatron-LM pads the vocabulary to a multiple of `make_vocab_size_divisible_by * TP`, so the stored
    `padded_vocab_size` (padded for the saving TP) may not divide the loading TP. Rounding it up to that
    multiple gives what Megatron-LM computes from the unpadded vocabulary; the embedding and output
    layer load with `allow_shape_mismatch`, the extra rows being zero.
    """
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
    return padded_vocab_size(args.padded_vocab_size, Parallelism(tp=tp, make_vocab_size_divisible_by=divisible_by))


# Without its local label: megatron-core's version carries the git commit of the working directory it runs in.
MEGATRON_CORE_VERSION = Version(megatron.core.__version__).public


def require_shared_expert_gate() -> None:
    """megatron-core before 0.16 has no config field for the shared expert's sigmoid gate (Qwen2-MoE):
    its MoE spec builds shared experts without one, so the gate's weight could not be loaded."""
    if not hasattr(TransformerConfig, "moe_shared_expert_gate"):
        raise ConversionError(
            f"megatron-core {MEGATRON_CORE_VERSION} cannot build this checkpoint's model: it has a shared "
            "expert gate (moe_shared_expert_gate), which megatron-core supports from 0.16 on; load it with "
            "megatron-core >= 0.16"
        )


def require_output_gate_above_query_groups(args: argparse.Namespace, tp: int) -> None:
    """megatron-core 0.16.1 cannot run attention with an output gate at TP above the query groups: the gates it
    takes are those of the whole group a rank gathers, which it fails to shape as its own heads' (0.19.2 slices
    them to the rank's heads; 0.17 and 0.18 were not tried, and are refused with it)."""
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    if getattr(args, "attention_output_gate", False) and tp > groups and Version(MEGATRON_CORE_VERSION) < Version("0.19"):
        raise ConversionError(
            f"megatron-core {MEGATRON_CORE_VERSION} cannot run attention with an output gate at TP {tp}, above the "
            f"{groups} query groups (its gates are the whole gathered group's): verify at TP {groups} or below, or with "
            "megatron-core 0.19 or later"
        )


def require_unnormalized_mla_query() -> None:
    """With q/k layer norms (the latent kv norm), megatron-core 0.19 builds multi-latent attention without a
    query bottleneck (q_lora_rank null: DeepSeek-V2-Lite) with a layer norm fused into linear_q_proj (its
    mla_qk_norm_config), a norm the model does not have; 0.13 to 0.18 project the query straight from the
    layer's input, as the model does (scripts/checks/mcore_versions.sh loads it with each)."""
    if importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None:
        raise ConversionError(
            f"megatron-core {MEGATRON_CORE_VERSION} cannot build this checkpoint's model: for multi-latent "
            "attention without q_lora_rank it adds a layer norm before linear_q_proj, which the model does not "
            "have; load it with megatron-core 0.13 to 0.18"
        )


def transformer_config_from_args(
    args: argparse.Namespace,
    params_dtype: torch.dtype,
    transformer_impl: TransformerImpl = "transformer_engine",
    perform_initialization: bool = True,
) -> TransformerConfig:
    """The TransformerConfig Megatron-LM derives from `args`, for the current parallel layout.

    Fusions and dropout are off: the model is only run forward, to compare numbers.
    `perform_initialization=False` skips the random init of weights a checkpoint will overwrite.
    """
    num_experts = getattr(args, "num_experts", None)
    moe_settings = {}
    if num_experts:
        moe_settings = dict(
            num_moe_experts=num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
            moe_shared_expert_intermediate_size=getattr(
                args, "moe_shared_expert_intermediate_size", None
            ),
            moe_router_pre_softmax=getattr(args, "moe_router_pre_softmax", False),
            moe_router_score_function=getattr(args, "moe_router_score_function", "softmax"),
            moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
            moe_router_enable_expert_bias=getattr(args, "moe_router_enable_expert_bias", False),
            moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
            moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
            moe_router_dtype=getattr(args, "moe_router_dtype", None),
            moe_layer_freq=getattr(args, "moe_layer_freq", 1),
            # The local spec's grouped gemm is the legacy GroupedMLP (CUDA-only grouped_gemm kernels,
            # other checkpoint keys); its SequentialMLP stores the keys TEGroupedMLP stores
            # (MCORE_FORMAT.md), so the local spec always uses SequentialMLP.
            moe_grouped_gemm=(
                getattr(args, "moe_grouped_gemm", False) and uses_transformer_engine(transformer_impl)
            ),
            moe_router_load_balancing_type=getattr(args, "moe_router_load_balancing_type", "aux_loss"),
            # The dispatcher only moves tokens to their experts and back, it does not change the
            # result; allgather is the one that runs on gloo (CPU) as well as NCCL.
            moe_token_dispatcher_type="allgather",
        )
        if getattr(args, "moe_shared_expert_gate", False):
            require_shared_expert_gate()
            moe_settings["moe_shared_expert_gate"] = True
    config_class, mla_settings = TransformerConfig, {}
    if getattr(args, "multi_latent_attention", False):
        if unnormalized_mla_query(args):
            require_unnormalized_mla_query()
        config_class = MLATransformerConfig
        mla_settings = dict(
            multi_latent_attention=True,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            rope_type=getattr(args, "rope_type", None) or "yarn",
            rotary_base=getattr(args, "rotary_base", 10000),
            rotary_scaling_factor=getattr(args, "rotary_scaling_factor", 1.0),
            mscale=getattr(args, "mscale", 1.0),
            mscale_all_dim=getattr(args, "mscale_all_dim", 0.0),
        )
        # Megatron-LM has no flags for these; args written by mconvert record MLATransformerConfig's defaults.
        for name in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
            if getattr(args, name, None) is not None:
                mla_settings[name] = getattr(args, name)
        if "original_max_position_embeddings" in mla_settings and not hasattr(MLATransformerConfig, "original_max_position_embeddings"):
            # megatron-core 0.13 names YaRN's original length max_position_embeddings.
            mla_settings["max_position_embeddings"] = mla_settings.pop("original_max_position_embeddings")
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        # Megatron-LM ignores --num-query-groups unless --group-query-attention is given.
        num_query_groups=(
            args.num_query_groups if getattr(args, "group_query_attention", False) else None
        ),
        kv_channels=getattr(args, "kv_channels", None),
        normalization=args.normalization,
        layernorm_epsilon=stored_arg(args, "layernorm_epsilon", 1e-5),
        gated_linear_unit=args.swiglu or getattr(args, "quick_geglu", False),
        activation_func=F.silu if args.swiglu else quick_gelu() if getattr(args, "quick_geglu", False) else (
            # megatron-core's own relu(x)^2 (--squared-relu), imported only for such models: 0.13 lacks the module
            importlib.import_module("megatron.core.activations").squared_relu
            if getattr(args, "squared_relu", False) else F.gelu
        ),
        **activation_settings(args),
        **mamba_settings(args),
        **linear_attention_settings(args),
        **sparse_attention_settings(args),
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        rotary_interleaved=getattr(args, "rotary_interleaved", False),
        window_size=getattr(args, "window_size", None),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Megatron-LM pairs the local spec with the local backend (megatron's own
        # DotProductAttention, the attention that runs on CPU).
        attention_backend=(
            AttnBackend.auto if uses_transformer_engine(transformer_impl) else AttnBackend.local
        ),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        # Sparse attention's absorbed MLA requires sequence parallelism at TP > 1; it changes no result.
        sequence_parallel=(
            getattr(args, "experimental_attention_variant", None) == "dsa"
            and parallel_state.get_tensor_model_parallel_world_size() > 1
        ),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=perform_initialization,
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        **pipeline_split_settings(args),
        **moe_settings,
        **mla_settings,
    )


def quick_gelu():
    """megatron-core's quick-GELU (gpt-oss's gate), from the release that has it: 0.13 and 0.14 have none."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


def activation_settings(args: argparse.Namespace) -> dict:
    """gpt-oss's clamped, offset gated MLP, its attention sinks and its windows on some layers only: only what
    the args set, so that megatron-core releases before these fields build the models without them."""
    names = ("glu_linear_offset", "activation_func_clamp_value", "window_attn_skip_freq")
    settings = {name: getattr(args, name) for name in names if getattr(args, name, None) not in (None, 0.0)}
    if getattr(args, "softmax_type", "vanilla") != "vanilla":
        settings["softmax_type"] = args.softmax_type
    return settings


def linear_attention_settings(args: argparse.Namespace) -> dict:
    """Qwen3-Next's and Qwen3.5's gated delta-net layers, gated attention and zero-centred norms: only what the
    args set, so that megatron-core releases before these fields build the other models."""
    settings = {}
    if stored_arg(args, "layernorm_zero_centered_gamma", False):
        settings["layernorm_zero_centered_gamma"] = True
    if getattr(args, "attention_output_gate", False):
        settings["attention_output_gate"] = True
    if getattr(args, "experimental_attention_variant", None) == "gated_delta_net":
        names = ("experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
        settings.update({name: getattr(args, name) for name in names})
    return settings


def sparse_attention_settings(args: argparse.Namespace) -> dict:
    """DeepSeek Sparse Attention's indexer, from megatron-core 0.19: 0.16's always rotates q and k by a Hadamard
    matrix (bf16 and fast-hadamard-transform only) and cannot rotate interleaved pairs."""
    if getattr(args, "experimental_attention_variant", None) != "dsa":
        return {}
    if Version(MEGATRON_CORE_VERSION) < Version("0.19"):
        raise ConversionError(
            f"sparse attention: megatron-core {MEGATRON_CORE_VERSION}'s indexer always applies the Hadamard rotation "
            f"(bf16 and fast-hadamard-transform only) and has no interleaved rope; verify with megatron-core 0.19 or later"
        )
    names = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
             "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "dsa_indexer_rope_interleaved",
             "dsa_indexer_rotate_activation", "dsa_indexer_k_norm_epsilon")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def yarn_settings(config: TransformerConfig, args: argparse.Namespace) -> None:
    """GPTModel's YaRN (not multi-latent attention's) reads its settings as attributes of the config that no
    field declares, as Megatron-LM sets them (argument_utils._apply_yarn_config_from_args)."""
    if getattr(args, "position_embedding_type", None) != "yarn" or getattr(args, "multi_latent_attention", False):
        return
    config.yarn_rotary_scaling_factor = args.rotary_scaling_factor
    config.yarn_original_max_position_embeddings = args.yarn_original_max_position_embeddings
    config.yarn_beta_fast = args.yarn_beta_fast
    config.yarn_beta_slow = args.yarn_beta_slow
    config.yarn_mscale = args.mscale
    config.yarn_mscale_all_dim = args.mscale_all_dim
    config.yarn_correction_range_round_to_int = args.yarn_correction_range_round_to_int


# TransformerConfig's name for a pipeline split arg where it is not the arg's (core_transformer_config_from_args).
_SPLIT_CONFIG_FIELDS = {
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}


def pipeline_split_settings(args: argparse.Namespace) -> dict:
    """How the layers are split over the pipeline stages, as `args` set it (only what they set: megatron-core
    releases before a field's arrival do not take it)."""
    return {
        _SPLIT_CONFIG_FIELDS.get(arg, arg): getattr(args, arg)
        for arg in PipelineSplit.ARGS.values() if getattr(args, arg, None) not in (None, False)
    }


def _layer_spec(
    config: TransformerConfig, args: argparse.Namespace, use_te: bool
) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec Megatron-LM's GPT model provider picks for these args."""
    if getattr(config, "experimental_attention_variant", None) is not None:
        if not use_te:
            return cpu_shims.experimental_block_without_te(config, args)
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        # Mixes linear and full attention, dense and MoE layers, and slices this pipeline stage's layers.
        return get_transformer_block_with_experimental_attention_variant_spec(config)
    if config.num_moe_experts:
        # Handles moe_layer_freq (dense and MoE layers mixed) and slices this pipeline stage's layers.
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization
        )
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention
        )
    else:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm,
            normalization=args.normalization,
            multi_latent_attention=config.multi_latent_attention,
        )
    if config.multi_latent_attention and not use_te:
        _fit_local_mla(spec)
    if tuple(getattr(args, "spec", None) or ()) == spec_names.QK_NORM_ACROSS_HEADS:
        layer_specs.with_qk_norm_across_heads(spec)  # what Megatron-LM's --spec gives it
    return spec


def _fit_local_mla(spec: ModuleSpec | TransformerBlockSubmodules) -> None:
    """megatron-core 0.16.1's local MLA layers, made buildable (see cpu_shims): the core attention that
    takes MLA's arguments, and MLA's own test for Transformer Engine."""
    cpu_shims.mla_without_transformer_engine()
    core_attention = cpu_shims.local_mla_core_attention()
    layers = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = core_attention


def build_gpt_model(
    args: argparse.Namespace,
    params_dtype: torch.dtype,
    pre_process: bool,
    post_process: bool,
    transformer_impl: TransformerImpl = "transformer_engine",
    perform_initialization: bool = True,
) -> GPTModel:
    """This rank's GPTModel (its pipeline stage's layers, its TP/EP shards), built on CPU."""
    config = transformer_config_from_args(
        args, params_dtype, transformer_impl, perform_initialization
    )
    yarn_settings(config, args)
    use_te = uses_transformer_engine(transformer_impl)
    layer_spec = _layer_spec(config, args, use_te)
    mtp_block_spec = None
    if config.mtp_num_layers:
        # Built on the last pipeline stage only, each layer like the decoder's last.
        mtp_block_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_te)
    return GPTModel(
        transformer_layer_spec=layer_spec,
        mtp_block_spec=mtp_block_spec,
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        **language_model_settings(config, args, pre_process, post_process),
    )


def language_model_settings(config: TransformerConfig, args: argparse.Namespace, pre_process: bool, post_process: bool) -> dict:
    """What GPTModel and HybridModel take alike from the args: vocabulary, stages, embeddings, rotary embedding."""
    return dict(
        config=config,
        vocab_size=padded_vocab_size_for_tp(args, config.tensor_model_parallel_size),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=getattr(args, "position_embedding_type", "learned_absolute"),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
    )
