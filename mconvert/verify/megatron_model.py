"""Build megatron-core's own GPTModel from a checkpoint's Megatron-LM `args`.

`args` is the `argparse.Namespace` Megatron-LM stores in `common.pt` (Megatron-LM's argument names, as
`--use-checkpoint-args` reads them). The parallel layout is not taken from `args` (that is the layout the
checkpoint was saved with) but from megatron-core's `parallel_state`, i.e. the layout of the ranks
that load it: torch_dist checkpoints are layout-independent.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import os
from typing import Any, Literal

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
from mconvert.mcore.parallelism import Parallelism, padded_vocab_size
from mconvert.megatron_lm import layer_specs, spec_names
from mconvert.megatron_lm.flags import unnormalized_mla_query
from mconvert.megatron_lm.setting import Getter
from mconvert.megatron_lm.settings import SETTINGS, getter, has_feature
from mconvert.verify import cpu_shims
from mconvert.verify.distributed import ParallelLayout

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
    layout: ParallelLayout | None = None,
) -> TransformerConfig:
    """The TransformerConfig Megatron-LM derives from `args` (core_transformer_config_from_args, over the settings
    table's rows), for the parallel layout of the ranks (megatron-core's parallel state; `layout` without ranks).

    Fusions and dropout are off: the model is only run forward, to compare numbers.
    `perform_initialization=False` skips the random init of weights a checkpoint will overwrite.
    """
    get = getter(args)
    config_class = MLATransformerConfig if get("multi_latent_attention") else TransformerConfig
    if get("multi_latent_attention") and unnormalized_mla_query(args):
        require_unnormalized_mla_query()
    require_sparse_attention_indexer(get)
    fields = {field.name for field in dataclasses.fields(config_class)}
    known = fields | {field.name for field in dataclasses.fields(MLATransformerConfig)}
    # megatron-core 0.13 names multi-latent attention's YaRN original length max_position_embeddings.
    renamed = {} if "original_max_position_embeddings" in known else {"original_max_position_embeddings": "max_position_embeddings"}
    settings = config_settings(args, fields, known, f"megatron-core {MEGATRON_CORE_VERSION}", renamed)
    if settings.get("rope_type", "") is None:
        settings.pop("rope_type")  # the config class's own default, as Megatron-LM leaves it
    run = run_settings(get, params_dtype, transformer_impl, perform_initialization, layout)  # over the model's where both set a field
    return config_class(**{**settings, **derived_settings(get), **run})


def derived_settings(get: Getter) -> dict:
    """The MLP's activation and whether it is gated, the query groups (Megatron-LM ignores --num-query-groups
    unless --group-query-attention is given), and whether the model is a HybridModel (its output layers' init then
    scales by the layer count, not twice it): what core_transformer_config_from_args derives from the args."""
    if get("swiglu"):
        activation = F.silu
    elif get("quick_geglu"):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu  # absent from megatron-core 0.13 and 0.14

        activation = quick_gelu
    elif get("squared_relu"):
        # megatron-core's own relu(x)^2, imported only for such models: 0.13 lacks the module.
        activation = importlib.import_module("megatron.core.activations").squared_relu
    else:
        activation = F.gelu
    return dict(
        gated_linear_unit=bool(get("swiglu") or get("quick_geglu")),
        activation_func=activation,
        num_query_groups=get("num_query_groups") if get("group_query_attention") else None,
        # Set only for a HybridModel (megatron-core 0.19 on; a GPT model's config keeps its default, in every version).
        **({"is_hybrid_model": True} if get("hybrid_layer_pattern") else {}),
    )


def run_settings(
    get: Getter, params_dtype: torch.dtype, transformer_impl: TransformerImpl, perform_initialization: bool,
    layout: ParallelLayout | None,
) -> dict:
    """What the run decides, not the model: the ranks' parallel sizes, the dtype, CPU initialization, and a forward
    pass without fusions or dropout, through megatron-core's own attention on CPU."""
    if layout is None:
        layout = ParallelLayout(
            parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_tensor_parallel_world_size(),
        )
    tp = layout.tp
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Megatron-LM pairs the local spec with the local backend (megatron's own DotProductAttention, the
        # attention that runs on CPU).
        attention_backend=AttnBackend.auto if uses_transformer_engine(transformer_impl) else AttnBackend.local,
        tensor_model_parallel_size=tp,
        # Sparse attention's absorbed MLA requires sequence parallelism at TP > 1; it changes no result.
        sequence_parallel=get("experimental_attention_variant") == "dsa" and tp > 1,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=perform_initialization,
        # The local spec's grouped gemm is the legacy GroupedMLP (CUDA-only grouped_gemm kernels, other checkpoint
        # keys); its SequentialMLP stores the keys TEGroupedMLP stores (MCORE_FORMAT.md), so the local spec always
        # uses SequentialMLP.
        moe_grouped_gemm=bool(get("moe_grouped_gemm")) and uses_transformer_engine(transformer_impl),
        # The dispatcher only moves tokens to their experts and back, it does not change the result; allgather is
        # the one that runs on gloo (CPU) as well as NCCL.
        moe_token_dispatcher_type="allgather",
        # Gated delta-net's convolution and chunked delta rule in PyTorch, as the reference runs them (hf_side): on the
        # GPU flash-linear-attention's Triton kernels part from them by enough to flip MoE routing.
        deterministic_mode=get("experimental_attention_variant") == "gated_delta_net",
    )


def require_sparse_attention_indexer(get: Getter) -> None:
    """DeepSeek Sparse Attention's indexer, from megatron-core 0.19: 0.16's always rotates q and k by a Hadamard
    matrix (bf16 and fast-hadamard-transform only) and cannot rotate interleaved pairs."""
    if get("experimental_attention_variant") == "dsa" and Version(MEGATRON_CORE_VERSION) < Version("0.19"):
        raise ConversionError(
            f"sparse attention: megatron-core {MEGATRON_CORE_VERSION}'s indexer always applies the Hadamard rotation "
            f"(bf16 and fast-hadamard-transform only) and has no interleaved rope; verify with megatron-core 0.19 or later"
        )


def config_settings(
    args: argparse.Namespace, fields: set[str], known: set[str], describe: str, renamed: dict[str, str]
) -> dict[str, Any]:
    """The fields of a TransformerConfig class (of `fields`) that the model's args set, as Megatron-LM's
    core_transformer_config_from_args copies them; the run's settings are the caller's. A field of another config
    class of the installed megatron-core (`known`: multi-latent attention's) is left out; one it does not know at all
    is left out where the args hold the parser's default, and an error where they do not: that megatron-core
    (`describe`) cannot build the model. `renamed`: the installed megatron-core's names of fields it names otherwise."""
    get = getter(args)
    settings = {}
    for setting in SETTINGS:
        field = renamed.get(setting.config_field, setting.config_field)
        if field is None or setting.run or not has_feature(setting, get):
            continue
        value = get(setting.arg)
        if field in fields:
            settings[field] = value
        elif field not in known and value != setting.default:
            raise ConversionError(
                f"{describe} cannot build this checkpoint's model: its TransformerConfig has no {field} "
                f"(the model has {setting.arg}={value!r}); load it with a later megatron-core"
            )
    return settings


def yarn_settings(config: TransformerConfig, args: argparse.Namespace) -> None:
    """GPTModel's YaRN (not multi-latent attention's) reads its settings as attributes of the config that no
    field declares, as Megatron-LM sets them (argument_utils._apply_yarn_config_from_args)."""
    get = getter(args)
    if get("position_embedding_type") != "yarn" or get("multi_latent_attention"):
        return
    config.yarn_rotary_scaling_factor = get("rotary_scaling_factor")
    config.yarn_original_max_position_embeddings = get("yarn_original_max_position_embeddings")
    config.yarn_beta_fast = get("yarn_beta_fast")
    config.yarn_beta_slow = get("yarn_beta_slow")
    config.yarn_mscale = get("mscale")
    config.yarn_mscale_all_dim = get("mscale_all_dim")
    config.yarn_correction_range_round_to_int = get("yarn_correction_range_round_to_int")


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
    # What Megatron-LM's --spec gives it.
    named = tuple(getattr(args, "spec", None) or ())
    if named == spec_names.QK_NORM_ACROSS_HEADS:
        layer_specs.with_qk_norm_across_heads(spec)
    elif named == spec_names.NORMS_AFTER_SUBLAYERS:
        layer_specs.with_norms_after_sublayers(spec, use_te)
    elif named == spec_names.GEMMA3_LAYERS:
        return layer_specs.with_norms_around_sublayers(spec, config, use_te, getattr(args, "rotary_seq_len_interpolation_factor", None))
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
    if config.deterministic_mode:
        # Transformer Engine's attention refuses deterministic mode unless told to keep to deterministic algorithms,
        # as Megatron-LM's --deterministic-mode tells it.
        os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
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
