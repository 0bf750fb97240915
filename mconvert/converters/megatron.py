"""Megatron-Core's side of a checkpoint, in one place: tensor shapes, key names, layer and expert stacking,
vocab padding, tensor-parallel sharding, `_extra_state` objects and the Megatron-LM arguments that describe
the model. The families in `mconvert.mappings` name Megatron tensors relative to their scope; this module
turns those names into checkpoint keys, global shapes and per-rank chunks.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import torch

from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec, MoESpec, RopeScaling

Shape = tuple[int, ...]

# Megatron-Core's module path of routed experts: the MoE layer's `experts` module holds its own `experts`.
EXPERTS_PREFIX = "mlp.experts.experts."
# The MoE post-attention norm: a module of its own under the Transformer Engine spec; the local spec stores it
# as `mlp.linear_fc1.layer_norm_weight`, as dense layers do under both. Written under both names so the
# checkpoint loads in both specs (checkpoint keys nobody asks for are ignored when loading).
MOE_NORM = "pre_mlp_layernorm.weight"
MOE_NORM_LOCAL = "mlp.linear_fc1.layer_norm_weight"
# Modules with `_extra_state` that own no tensor we write: attention's core (asked for by megatron-core 0.13/0.14).
EXTRA_STATE_ONLY_MODULES = ("self_attention.core_attention",)


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # Expert tensor parallelism; None means Megatron's default, the same as tp.
    etp: int | None = None
    make_vocab_size_divisible_by: int = 128

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def validate(self, spec: ModelSpec) -> None:
        """Reject sizes Megatron cannot shard this model by, naming the flag, before anything is written."""
        for flag, size in (("--tp", self.tp), ("--pp", self.pp), ("--ep", self.ep), ("--etp", self.expert_tp)):
            if size < 1:
                raise ConversionError(f"{flag} {size}: must be at least 1")
        checks = [
            ("--tp", self.tp, "num_attention_heads", spec.num_attention_heads),
            ("--tp", self.tp, "num_key_value_heads (query groups)", spec.num_query_groups),
            ("--pp", self.pp, "num_hidden_layers", spec.num_layers),
        ]
        if spec.moe is None or not all(spec.moe.moe_layers):
            checks.append(("--tp", self.tp, "intermediate_size", spec.ffn_hidden_size))
        if spec.moe is not None:
            checks += [
                ("--ep", self.ep, "the number of experts", spec.moe.num_experts),
                ("--etp", self.expert_tp, "the experts' intermediate size", spec.moe.ffn_hidden_size),
            ]
            if spec.moe.shared_expert_ffn_hidden_size:
                checks.append(("--tp", self.tp, "shared_expert_intermediate_size", spec.moe.shared_expert_ffn_hidden_size))
        elif self.ep != 1 or self.etp not in (None, 1, self.tp):
            raise ConversionError(f"--ep/--etp: the model has no experts ({spec.family} is dense)")
        for flag, size, what, value in checks:
            if value % size:
                raise ConversionError(f"{flag} {size} does not divide {what} ({value})")


def padded_vocab_size(vocab_size: int, par: Parallelism) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP (extra rows are zero)."""
    multiple = par.make_vocab_size_divisible_by * par.tp
    return math.ceil(vocab_size / multiple) * multiple


@dataclass(frozen=True)
class TensorLayout:
    """A Megatron tensor within its scope: its shape and how tensor parallelism splits it.

    Ranks read `fragments` equal parts along `split_axis`. For fused gate/up (fc1) there are 2 x TP of them:
    rank r holds gate part r and up part r + TP, so the stored tensor stays [gate; up] whatever TP is.
    """

    shape: Shape
    split_axis: int | None = None
    fragments: int = 1
    # Rows that hold real data; the rest up to shape[0] is zero padding (the vocabulary).
    real_rows: int | None = None


def tensor_layout(name: str, spec: ModelSpec, par: Parallelism, expert: bool = False) -> TensorLayout:
    """Shape and TP split of the Megatron tensor `name` (relative to its model, layer or expert scope)."""
    H, d = spec.hidden_size, spec.head_dim
    tp = par.expert_tp if expert else par.tp
    moe: MoESpec | None = spec.moe
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return TensorLayout((padded_vocab_size(spec.vocab_size, par), H), 0, par.tp, real_rows=spec.vocab_size)
    if name.endswith("norm.weight") or name.endswith("layer_norm_weight"):
        norm_size = d if name.startswith("self_attention.q_") or name.startswith("self_attention.k_") else H
        return TensorLayout((norm_size,))
    qkv_rows = spec.num_query_groups * (spec.num_attention_heads // spec.num_query_groups + 2) * d
    if expert:
        ffn = moe.ffn_hidden_size
    elif name.startswith("mlp.shared_experts."):
        ffn = moe.shared_expert_ffn_hidden_size
    else:
        ffn = spec.ffn_hidden_size
    module, param = name.rsplit(".", 1)
    if module.endswith("linear_qkv"):
        return TensorLayout((qkv_rows, H) if param == "weight" else (qkv_rows,), 0, tp)
    if module.endswith("linear_proj"):
        return TensorLayout((H, spec.num_attention_heads * d), 1, tp) if param == "weight" else TensorLayout((H,))
    if module.endswith("linear_fc1"):
        return TensorLayout((2 * ffn, H) if param == "weight" else (2 * ffn,), 0, 2 * tp)
    if module.endswith("linear_fc2"):
        return TensorLayout((H, ffn), 1, tp) if param == "weight" else TensorLayout((H,))
    if name == "mlp.router.weight":
        return TensorLayout((moe.num_experts, H))
    if name == "mlp.shared_experts.gate_weight":
        return TensorLayout((1, H))
    raise ConversionError(f"no Megatron layout known for tensor '{name}'")


def layer_key(name: str, layer: int, spec: ModelSpec) -> tuple[str, tuple[int, ...]]:
    """Checkpoint key and leading offsets of a layer's tensor: stacked along a layer axis when all layers are
    alike, else one key per layer."""
    if spec.uniform_layers:
        return f"decoder.layers.{name}", (layer,)
    return f"decoder.layers.{layer}.{name}", ()


def layer_axis(spec: ModelSpec) -> Shape:
    return (spec.num_layers,) if spec.uniform_layers else ()


def extra_state_key(module_key: str, offsets: tuple[int, ...], leading_shape: Shape) -> str:
    """The ShardedObject key megatron-core asks for a module's `_extra_state` (see make_sharded_object_for_checkpoint)."""
    if not offsets:
        offsets, leading_shape = (0,), (1,)
    return f"{module_key}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, leading_shape))}"


def megatron_args(spec: ModelSpec, par: Parallelism, dtype: torch.dtype, transformer_impl: str) -> argparse.Namespace:
    """The Megatron-LM arguments that describe the model, as `--use-checkpoint-args` reads them from common.pt."""
    rope: RopeScaling | None = spec.rope_scaling
    args: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        seq_length=min(spec.max_position_embeddings, 4096),
        position_embedding_type="rope",
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        rotary_base=spec.rope_theta,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=rope is not None and rope.kind == "llama3",
        rope_scaling_factor=rope.factor if rope is not None and rope.kind == "llama3" else 8.0,
        rotary_seq_len_interpolation_factor=rope.factor if rope is not None and rope.kind == "linear" else None,
        normalization="RMSNorm",
        norm_epsilon=spec.norm_eps,
        apply_layernorm_1p=False,
        swiglu=True,
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        untie_embeddings_and_output_weights=spec.untie_embeddings,
        vocab_size=spec.vocab_size,
        padded_vocab_size=padded_vocab_size(spec.vocab_size, par),
        make_vocab_size_divisible_by=par.make_vocab_size_divisible_by,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        virtual_pipeline_model_parallel_size=None,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        transformer_impl=transformer_impl,
        num_experts=None,
    )
    if spec.moe is not None:
        moe = spec.moe
        args.update(
            num_experts=moe.num_experts,
            moe_router_topk=moe.top_k,
            moe_ffn_hidden_size=moe.ffn_hidden_size,
            moe_router_pre_softmax=moe.router_pre_softmax,
            moe_layer_freq=1 if all(moe.moe_layers) else [int(is_moe) for is_moe in moe.moe_layers],
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
            # Grouped GEMM experts are TEGroupedMLP under Transformer Engine; the local spec's would be the
            # legacy GroupedMLP (CUDA-only grouped_gemm package), so it gets SequentialMLP. Same checkpoint keys.
            moe_grouped_gemm=transformer_impl == "transformer_engine",
            moe_router_load_balancing_type="aux_loss",
            moe_token_dispatcher_type="alltoall",
        )
    return argparse.Namespace(**args)


def megatron_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM command-line flags for the model that `args` describes (a MODEL_ARGS block)."""
    a = args
    flags = [
        f"--num-layers {a.num_layers}",
        f"--hidden-size {a.hidden_size}",
        f"--ffn-hidden-size {a.ffn_hidden_size}",
        f"--num-attention-heads {a.num_attention_heads}",
        f"--kv-channels {a.kv_channels}",
        f"--max-position-embeddings {a.max_position_embeddings}",
        "--position-embedding-type rope",
        f"--rotary-base {a.rotary_base:g}",
        "--normalization RMSNorm",
        f"--norm-epsilon {a.norm_epsilon:g}",
        "--swiglu",
        f"--vocab-size {a.vocab_size}",
        f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by}",
        f"--tensor-model-parallel-size {a.tensor_model_parallel_size}",
        f"--pipeline-model-parallel-size {a.pipeline_model_parallel_size}",
        f"--transformer-impl {a.transformer_impl}",
    ]
    if a.group_query_attention:
        flags += ["--group-query-attention", f"--num-query-groups {a.num_query_groups}"]
    if a.use_rope_scaling:
        flags += ["--use-rope-scaling", f"--rope-scaling-factor {a.rope_scaling_factor:g}"]
    if a.rotary_seq_len_interpolation_factor is not None:
        flags.append(f"--rotary-seq-len-interpolation-factor {a.rotary_seq_len_interpolation_factor:g}")
    flags.append("--add-bias-linear" if a.add_bias_linear else "--disable-bias-linear")
    if a.add_qkv_bias and not a.add_bias_linear:
        flags.append("--add-qkv-bias")
    if a.qk_layernorm:
        flags.append("--qk-layernorm")
    if a.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    if a.bf16:
        flags.append("--bf16")
    elif a.fp16:
        flags.append("--fp16")
    if a.num_experts:
        flags += [
            f"--num-experts {a.num_experts}",
            f"--moe-router-topk {a.moe_router_topk}",
            f"--moe-ffn-hidden-size {a.moe_ffn_hidden_size}",
            f"--expert-model-parallel-size {a.expert_model_parallel_size}",
            f"--expert-tensor-parallel-size {a.expert_tensor_parallel_size}",
            f"--moe-router-load-balancing-type {a.moe_router_load_balancing_type}",
            f"--moe-token-dispatcher-type {a.moe_token_dispatcher_type}",
        ]
        if a.moe_grouped_gemm:
            flags.append("--moe-grouped-gemm")
        if a.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if a.moe_layer_freq != 1:
            flags.append("--moe-layer-freq '" + str(a.moe_layer_freq).replace(" ", "") + "'")
        if a.moe_shared_expert_intermediate_size:
            flags.append(f"--moe-shared-expert-intermediate-size {a.moe_shared_expert_intermediate_size}")
        if a.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
    return flags
