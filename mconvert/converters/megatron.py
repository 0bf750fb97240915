"""Megatron-Core's side of a checkpoint, in one place: tensor shapes, key names, layer and expert stacking,
vocab padding, tensor-parallel sharding, `_extra_state` objects and the Megatron-LM arguments that describe
the model. The families in `mconvert.mappings` name Megatron tensors relative to their scope; this module
turns those names into checkpoint keys, global shapes and per-rank chunks.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import ConversionError
from mconvert.mappings.spec import MLASpec, ModelSpec, MoESpec, RopeScaling

Shape = tuple[int, ...]

# Checkpoint keys that hold model weights; others (optimizer state, RNG state, `_extra_state`) are not read.
# `mtp.` holds the multi-token prediction layers.
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
# Megatron-Core's module path of routed experts: the MoE layer's `experts` module holds its own `experts`.
EXPERTS_PREFIX = "mlp.experts.experts."
# The MoE post-attention norm: a module of its own under the Transformer Engine spec; the local spec stores it
# as `mlp.linear_fc1.layer_norm_weight`, as dense layers do under both. Written under both names so the
# checkpoint loads in both specs (checkpoint keys nobody asks for are ignored when loading).
MOE_NORM = "pre_mlp_layernorm.weight"
MOE_NORM_LOCAL = "mlp.linear_fc1.layer_norm_weight"
# How the local (non-TE) spec's module names map to checkpoint names (its `sharded_state_dict_keys_map`): its
# norms are modules of their own, stored under the names of the TE layers they are fused into.
LOCAL_SPEC_RENAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# Multi-latent attention: the latent norms are fused into the up projections under the Transformer Engine spec
# and modules of their own under the local spec, whose MLA layers have no key map at all (so a dense layer's
# post-attention norm is `pre_mlp_layernorm` there). Written under both names, as MOE_NORM.
MLA_LOCAL_SPEC_NAMES = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
# Modules with `_extra_state` that own no tensor we write: attention's core (asked for by megatron-core 0.13/0.14).
EXTRA_STATE_ONLY_MODULES = ("self_attention.core_attention",)


@dataclass(frozen=True)
class PipelineSplit:
    """How Megatron-LM splits the decoder layers over the pipeline stages, by its flags; evenly by default.
    torch_dist stores each layer at its global index whatever the split, so it shapes the flags, not the
    checkpoint: models whose layer count no pipeline size of interest divides (DeepSeek-V3's 61, Qwen3-235B's
    94) train at PP > 1 only with one of these."""

    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    embedding_counts: bool = False  # --account-for-embedding-in-pipeline-split
    loss_counts: bool = False  # --account-for-loss-in-pipeline-split
    layout: str | None = None  # --pipeline-model-parallel-layout, e.g. "Et*3|(tt|)*29,m|L"

    # Megatron-LM's arg of each field, in its 0.19.2 parser.
    ARGS = {
        "first_stage_layers": "decoder_first_pipeline_num_layers",
        "last_stage_layers": "decoder_last_pipeline_num_layers",
        "embedding_counts": "account_for_embedding_in_pipeline_split",
        "loss_counts": "account_for_loss_in_pipeline_split",
        "layout": "pipeline_model_parallel_layout",
    }

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PipelineSplit":
        """The split stored args record; a layout only as Megatron-LM stores it, a string (megatron-core's
        config also takes a list, which is not read)."""
        values = {field: getattr(args, arg, None) for field, arg in cls.ARGS.items()}
        values = {field: cls.__dataclass_fields__[field].default if value is None else value for field, value in values.items()}
        if not isinstance(values["layout"], (str, type(None))):
            values["layout"] = None
        return cls(**values)

    def args(self, pp: int) -> dict[str, Any]:
        """The split as Megatron-LM's args, with the virtual pipeline size its validation derives from a layout
        of several stages a rank (None for one)."""
        virtual = len(self.stages()) // pp if self.layout is not None else 1
        return {arg: getattr(self, field) for field, arg in self.ARGS.items()} | {
            "virtual_pipeline_model_parallel_size": virtual if virtual > 1 else None
        }

    def flags(self) -> list[str]:
        """The split as Megatron-LM's flags (none for the even split)."""
        flags = []
        for field, arg in self.ARGS.items():
            value, flag = getattr(self, field), "--" + arg.replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is not None and value is not False:
                flags.append(f"{flag} {shlex.quote(str(value))}")
        return flags

    def stages(self) -> list[str]:
        """A layout's stages, its repetitions unrolled, as megatron-core reads it ("E", "L", "t", "m" a layer);
        stage i runs on pipeline rank i % pp."""
        layout = self.layout.replace(",", "")
        for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
            layout = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), layout)
        return layout.split("|")

    def check(self, pp: int, num_layers: int, mtp_layers: int = 0) -> None:
        """Megatron's rules for the split (Megatron-LM's validate_args and megatron-core's TransformerConfig,
        0.19.2), each refusal naming the flag."""
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if self.layout is not None:
            if uneven or self.embedding_counts or self.loss_counts:
                raise ConversionError("--pipeline-model-parallel-layout: not with the other pipeline split flags")
            self._check_layout(pp, num_layers, mtp_layers)
        elif uneven:
            if self.embedding_counts or self.loss_counts:
                raise ConversionError(
                    "--decoder-first/last-pipeline-num-layers: not with --account-for-embedding/loss-in-pipeline-split"
                )
            middle_layers, middle_stages = num_layers, pp
            for flag, layers in (("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                                 ("--decoder-last-pipeline-num-layers", self.last_stage_layers)):
                if layers is not None:
                    if layers < 1:
                        raise ConversionError(f"{flag} {layers}: must be at least 1")
                    middle_layers, middle_stages = middle_layers - layers, middle_stages - 1
            if middle_layers < 0:
                raise ConversionError(
                    f"--decoder-first/last-pipeline-num-layers take {num_layers - middle_layers} layers, the model has {num_layers}"
                )
            if middle_stages < 0 or bool(middle_layers) != bool(middle_stages):
                raise ConversionError(
                    f"--pp {pp}: --decoder-first/last-pipeline-num-layers leave {middle_layers} layers for "
                    f"{max(middle_stages, 0)} middle stages"
                )
            if middle_stages and middle_layers % middle_stages:
                raise ConversionError(
                    f"--pp {pp}: the {middle_layers} layers between the first and last stages do not divide over "
                    f"its {middle_stages} middle stages"
                )
        else:
            counted = num_layers + self.embedding_counts + self.loss_counts
            if counted % pp:
                what = f"num_hidden_layers ({num_layers})"
                if self.embedding_counts or self.loss_counts:
                    what += " with the embedding and loss counted as layers"
                raise ConversionError(
                    f"--pp {pp} does not divide {what}: split the layers unevenly with "
                    "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout"
                )

    def _check_layout(self, pp: int, num_layers: int, mtp_layers: int) -> None:
        flag = f"--pipeline-model-parallel-layout {self.layout!r}"
        stages = self.stages()
        unknown = sorted(set("".join(stages)) - set("ELtm"))
        if unknown:
            raise ConversionError(f"{flag}: unknown layer '{unknown[0]}' (E embedding, t decoder layer, m MTP layer, L loss)")
        if len(stages) % pp:
            raise ConversionError(f"{flag}: {len(stages)} stages, not a multiple of --pp {pp}")
        layers = "".join(stages)
        if layers.count("E") != 1 or layers.count("L") != 1 or not layers.startswith("E") or not layers.endswith("L"):
            raise ConversionError(f"{flag}: the embedding (E) must come first and the loss (L) last, once each")
        if layers.count("t") != num_layers:
            raise ConversionError(f"{flag}: {layers.count('t')} decoder layers (t), the model has {num_layers}")
        if layers.count("m") != mtp_layers:
            raise ConversionError(f"{flag}: {layers.count('m')} MTP layers (m), the converted model has {mtp_layers}")
        if "m" in layers and "t" in layers[layers.index("m") :]:
            raise ConversionError(f"{flag}: the MTP layers (m) must follow every decoder layer (t)")
        virtual = len(stages) // pp
        if virtual > 1 and pp == 1:
            raise ConversionError(f"{flag}: {len(stages)} stages on one rank; an interleaved schedule needs --pp 2 or more")
        if "m" in "".join(stages[: len(stages) - pp]):
            raise ConversionError(f"{flag}: the MTP layers (m) must be in a rank's last virtual stage")
        if mtp_layers and not any(stages[(virtual - 1) * pp + rank].count("m") == mtp_layers for rank in range(pp)):
            raise ConversionError(f"{flag}: the MTP layers (m) must all be in one stage")


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # Expert tensor parallelism; None means Megatron's default, the same as tp.
    etp: int | None = None
    make_vocab_size_divisible_by: int = 128
    pipeline: PipelineSplit = PipelineSplit()

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
        self.pipeline.check(self.pp, spec.num_layers, spec.mtp_layers)


def checkpoint_names(name: str, spec: ModelSpec, is_moe_layer: bool) -> tuple[str, ...]:
    """The names a layer's tensor `name` is written under: its Transformer Engine spec name first, then the
    local spec's where that differs."""
    if is_moe_layer and name == MOE_NORM:
        return (name, MOE_NORM_LOCAL)
    if spec.mla is not None and name in MLA_LOCAL_SPEC_NAMES:
        return (name, MLA_LOCAL_SPEC_NAMES[name])
    return (name,)


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
    # The dtype the tensor has whatever the weights' dtype: Megatron keeps the router's expert bias in fp32
    # (as transformers keeps e_score_correction_bias), since bf16 steps are coarser than its updates.
    dtype: torch.dtype | None = None


def tensor_layout(name: str, spec: ModelSpec, par: Parallelism, expert: bool = False) -> TensorLayout:
    """Shape and TP split of the Megatron tensor `name` (relative to its model, layer or expert scope)."""
    H, d = spec.hidden_size, spec.head_dim
    tp = par.expert_tp if expert else par.tp
    moe: MoESpec | None = spec.moe
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return TensorLayout((padded_vocab_size(spec.vocab_size, par), H), 0, par.tp, real_rows=spec.vocab_size)
    if spec.mla is not None and name.startswith("self_attention."):
        return _mla_layout(name, spec, par)
    if name == "eh_proj.weight":
        return TensorLayout((H, 2 * H), 0, par.tp)
    if name == "mlp.router.expert_bias":
        return TensorLayout((moe.num_experts,), dtype=torch.float32)
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


def _mla_layout(name: str, spec: ModelSpec, par: Parallelism) -> TensorLayout:
    """Multi-latent attention's tensors. The down projections are replicated across TP ranks (Transformer
    Engine's duplicated linears); the up projections split whole heads; linear_proj splits its input."""
    mla, heads, H = spec.mla, spec.num_attention_heads, spec.hidden_size
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    layouts = {
        "self_attention.linear_q_down_proj.weight": TensorLayout((mla.q_lora_rank, H)),
        "self_attention.linear_q_up_proj.layer_norm_weight": TensorLayout((mla.q_lora_rank,)),
        "self_attention.linear_q_up_proj.weight": TensorLayout((heads * q_head, mla.q_lora_rank), 0, par.tp),
        "self_attention.linear_q_proj.weight": TensorLayout((heads * q_head, H), 0, par.tp),
        "self_attention.linear_kv_down_proj.weight": TensorLayout((mla.kv_lora_rank + mla.qk_pos_emb_head_dim, H)),
        "self_attention.linear_kv_up_proj.layer_norm_weight": TensorLayout((mla.kv_lora_rank,)),
        "self_attention.linear_kv_up_proj.weight": TensorLayout(
            (heads * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank), 0, par.tp
        ),
        "self_attention.linear_proj.weight": TensorLayout((H, heads * mla.v_head_dim), 1, par.tp),
    }
    if name not in layouts:
        raise ConversionError(f"no Megatron layout known for multi-latent attention tensor '{name}'")
    return layouts[name]


def mtp_key(name: str, mtp_layer: int) -> str:
    """A multi-token prediction layer's key (megatron-core 0.16.1's MultiTokenPredictionBlock: never stacked)."""
    return f"mtp.layers.{mtp_layer}.{name}"


def layer_key(name: str, layer: int, spec: ModelSpec) -> tuple[str, tuple[int, ...]]:
    """Checkpoint key and leading offsets of a layer's tensor: stacked along a layer axis when all layers are
    alike, else one key per layer. Layers from num_layers on are the decoder layers of the multi-token
    prediction layers."""
    if layer >= spec.num_layers:
        return mtp_key(f"transformer_layer.{name}", layer - spec.num_layers), ()
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


# Args that Megatron-LM's `--use-checkpoint-args` copies from a checkpoint's stored args
# (megatron.training.checkpointing.load_args_from_checkpoint, Megatron-LM 0.19.2; tests/megatron_lm reads
# the installed function to keep this in step). Everything else that shapes the model must be passed.
RESTORED_BY_CHECKPOINT_ARGS = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling",
    "attention_dropout", "hidden_dropout", "mtp_hybrid_override_pattern", "mtp_num_layers", "mtp_use_repeated_layer",
    "spec", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type",
    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_single_grouped_weight", "moe_single_grouped_bias",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "hybrid_layer_pattern", "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json",
    "moe_latent_size", "tokenizer_model", "tokenizer_type", "tiktoken_pattern", "padded_vocab_size", "ckpt_format",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
})
# Megatron-LM's defaults (its argument parser, 0.19.2; tests/megatron_lm checks them) of the args that shape
# the model or how it trains: the model a run builds from a flag left out.
MEGATRON_LM_DEFAULTS: dict[str, Any] = {
    "num_layers": None, "hidden_size": None, "ffn_hidden_size": None, "num_attention_heads": None,
    "kv_channels": None, "group_query_attention": False, "num_query_groups": 1, "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "rotary_interleaved": False, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None, "normalization": "LayerNorm", "layernorm_epsilon": 1e-5,
    "swiglu": False, "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
    "untie_embeddings_and_output_weights": False, "attention_dropout": 0.1, "hidden_dropout": 0.1,
    "window_size": None, "num_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
    "moe_router_pre_softmax": False, "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False, "moe_aux_loss_coeff": 0.0, "moe_router_dtype": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
    "pipeline_model_parallel_layout": None,
}
# Args whose name in Megatron-LM 0.19 (its parser's dest, after TransformerConfig's field) differs from the
# flag's, and from the name earlier Megatron-LM versions store: both names are written, either is read.
RENAMED_ARGS = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p"}
FLAG_OF_ARG = {
    "layernorm_epsilon": "--norm-epsilon", "layernorm_zero_centered_gamma": "--apply-layernorm-1p", "add_bias_linear": "--disable-bias-linear",
}
# Files that make an HF directory usable as Megatron-LM's `--tokenizer-model` for HuggingFaceTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def stored_arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """An arg as stored by any Megatron-LM version (by its 0.19 name, or the earlier one), else `default`."""
    value = getattr(args, name, None)
    if value is None and name in RENAMED_ARGS:
        value = getattr(args, RENAMED_ARGS[name], None)
    return default if value is None else value


def _integral(value: float, flag: str, field: str) -> int:
    """`value` as the int Megatron-LM's parser declares `flag` to be; a fraction would be rounded there, so it
    is an error here."""
    if value != int(value):
        raise ConversionError(f"{field} {value:g}: Megatron-LM's {flag} takes only integers, so this model cannot be described")
    return int(value)


def megatron_args(
    spec: ModelSpec, par: Parallelism, dtype: torch.dtype, transformer_impl: str, tokenizer_dir: Path | None = None
) -> argparse.Namespace:
    """The Megatron-LM arguments that describe the model, as `--use-checkpoint-args` reads them from common.pt.
    `tokenizer_dir`: the HF directory, recorded as the tokenizer when it has tokenizer files."""
    rope: RopeScaling | None = spec.rope_scaling
    linear_factor = None
    if rope is not None and rope.kind == "linear":
        linear_factor = _integral(rope.factor, "--rotary-seq-len-interpolation-factor", "rope_scaling factor")
    has_tokenizer = tokenizer_dir is not None and any((tokenizer_dir / name).exists() for name in TOKENIZER_FILES)
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
        rotary_base=_integral(spec.rope_theta, "--rotary-base", "rope_theta"),
        rotary_percent=spec.rotary_percent,
        rotary_interleaved=False,
        use_rope_scaling=rope is not None and rope.kind == "llama3",
        rope_scaling_factor=rope.factor if rope is not None and rope.kind == "llama3" else 8.0,
        rotary_seq_len_interpolation_factor=linear_factor,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        norm_epsilon=spec.norm_eps,
        layernorm_zero_centered_gamma=False,
        apply_layernorm_1p=False,
        swiglu=True,
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        untie_embeddings_and_output_weights=spec.untie_embeddings,
        # Megatron-LM's (left, right) window excludes the position itself; HF's `sliding_window` counts it.
        window_size=(spec.sliding_window - 1, 0) if spec.sliding_window is not None else None,
        vocab_size=spec.vocab_size,
        padded_vocab_size=padded_vocab_size(spec.vocab_size, par),
        make_vocab_size_divisible_by=par.make_vocab_size_divisible_by,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        **par.pipeline.args(par.pp),
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        # HF models train with the config's attention dropout and no hidden dropout; Megatron-LM's default is 0.1.
        attention_dropout=spec.attention_dropout,
        hidden_dropout=0.0,
        transformer_impl=transformer_impl,
        tokenizer_type="HuggingFaceTokenizer" if has_tokenizer else None,
        tokenizer_model=str(tokenizer_dir.absolute()) if has_tokenizer else None,
        num_experts=None,
        mtp_num_layers=spec.mtp_layers or None,
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
            moe_aux_loss_coeff=moe.aux_loss_coeff,
            moe_token_dispatcher_type="alltoall",
        )
        args.update(_router_args(moe))
    if rope is not None and rope.kind == "yarn" and spec.mla is None:
        raise ConversionError("yarn rope scaling is supported with multi-latent attention only")
    if spec.mla is not None:
        args.update(_mla_args(spec))
    return argparse.Namespace(**args)


def _router_args(moe: MoESpec) -> dict[str, Any]:
    """DeepSeek-V3 and GLM-4.5 routing: sigmoid scores, an expert bias that only chooses experts, scaled
    weights, group-limited choice, fp32 routing."""
    return dict(
        moe_router_dtype="fp32" if moe.router_fp32 else None,
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
    )


# Megatron-LM has no flags for these YaRN settings under multi-latent attention: MLATransformerConfig's
# defaults, which megatron-core 0.16.1 and Megatron-LM 0.19.2 share, are the only values it can take.
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _mla_args(spec: ModelSpec) -> dict[str, Any]:
    """Multi-latent attention. Its latent norms exist only with qk_layernorm; rope is MLA's own (YaRN when the
    model scales it, plain otherwise: an unscaled YaRN needs rotary_scaling_factor 1, not MLA's default 40)."""
    mla, rope = spec.mla, spec.rope_scaling
    if rope is not None and rope.kind != "yarn":
        raise ConversionError(f"rope scaling '{rope.kind}' cannot be expressed with multi-latent attention (yarn can)")
    if rope is not None:
        for field, fixed in MLA_YARN_FIXED.items():
            if getattr(rope, field) != fixed:
                raise ConversionError(
                    f"yarn {field} {getattr(rope, field):g}: Megatron-LM's multi-latent attention fixes it at {fixed:g}"
                )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        qk_layernorm=True,
        rope_type="yarn" if rope is not None else "rope",
        rotary_scaling_factor=rope.factor if rope is not None else 1.0,
        mscale=rope.mscale if rope is not None else 1.0,
        mscale_all_dim=rope.mscale_all_dim if rope is not None else 0.0,
        **MLA_YARN_FIXED,
    )


def megatron_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM command-line flags for the model that `args` describe (a MODEL_ARGS block), each value in
    the form Megatron-LM's parser takes."""
    a = args
    flags = [
        f"--num-layers {a.num_layers}",
        f"--hidden-size {a.hidden_size}",
        f"--ffn-hidden-size {a.ffn_hidden_size}",
        f"--num-attention-heads {a.num_attention_heads}",
        f"--kv-channels {a.kv_channels}",
        f"--max-position-embeddings {a.max_position_embeddings}",
        f"--seq-length {a.seq_length}",
        "--position-embedding-type rope",
        f"--rotary-base {a.rotary_base}",
        "--normalization RMSNorm",
        f"--norm-epsilon {a.layernorm_epsilon:g}",
        "--swiglu",
        f"--attention-dropout {a.attention_dropout:g}",
        f"--hidden-dropout {a.hidden_dropout:g}",
        f"--vocab-size {a.vocab_size}",
        f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by}",
        f"--tensor-model-parallel-size {a.tensor_model_parallel_size}",
        f"--pipeline-model-parallel-size {a.pipeline_model_parallel_size}",
        *PipelineSplit.from_args(a).flags(),
        f"--transformer-impl {a.transformer_impl}",
    ]
    if a.rotary_percent != 1.0:
        flags.append(f"--rotary-percent {a.rotary_percent:g}")
    if a.group_query_attention:
        flags += ["--group-query-attention", f"--num-query-groups {a.num_query_groups}"]
    if a.use_rope_scaling:
        flags += ["--use-rope-scaling", f"--rope-scaling-factor {a.rope_scaling_factor:g}"]
    if a.rotary_seq_len_interpolation_factor is not None:
        flags.append(f"--rotary-seq-len-interpolation-factor {a.rotary_seq_len_interpolation_factor}")
    if a.window_size is not None:
        flags.append(f"--window-size {a.window_size[0]},{a.window_size[1]}")
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
    if a.tokenizer_type is not None:
        flags += [f"--tokenizer-type {a.tokenizer_type}", f"--tokenizer-model {shlex.quote(a.tokenizer_model)}"]
    if a.num_experts:
        flags += [
            f"--num-experts {a.num_experts}",
            f"--moe-router-topk {a.moe_router_topk}",
            f"--moe-ffn-hidden-size {a.moe_ffn_hidden_size}",
            f"--expert-model-parallel-size {a.expert_model_parallel_size}",
            f"--expert-tensor-parallel-size {a.expert_tensor_parallel_size}",
            f"--moe-router-load-balancing-type {a.moe_router_load_balancing_type}",
            f"--moe-aux-loss-coeff {a.moe_aux_loss_coeff:g}",
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
        flags += _router_flags(a)
    if getattr(a, "multi_latent_attention", False):
        flags += _mla_flags(a)
    if getattr(a, "mtp_num_layers", None):
        flags.append(f"--mtp-num-layers {a.mtp_num_layers}")
    return flags


def _router_flags(a: argparse.Namespace) -> list[str]:
    flags = []
    if getattr(a, "moe_router_dtype", None) is not None:
        flags.append(f"--moe-router-dtype {a.moe_router_dtype}")
    if a.moe_router_score_function != "softmax":
        flags.append(f"--moe-router-score-function {a.moe_router_score_function}")
    if a.moe_router_enable_expert_bias:
        flags.append("--moe-router-enable-expert-bias")
    if a.moe_router_topk_scaling_factor is not None:
        flags.append(f"--moe-router-topk-scaling-factor {a.moe_router_topk_scaling_factor:g}")
    if a.moe_router_num_groups is not None:
        flags += [f"--moe-router-num-groups {a.moe_router_num_groups}", f"--moe-router-group-topk {a.moe_router_group_topk}"]
    return flags


def _mla_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--multi-latent-attention"]
    if a.q_lora_rank is not None:
        flags.append(f"--q-lora-rank {a.q_lora_rank}")
    flags += [
        f"--kv-lora-rank {a.kv_lora_rank}",
        f"--qk-head-dim {a.qk_head_dim}",
        f"--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim}",
        f"--v-head-dim {a.v_head_dim}",
        f"--rope-type {a.rope_type}",
        f"--rotary-scaling-factor {a.rotary_scaling_factor:g}",
        f"--mscale {a.mscale:g}",
        f"--mscale-all-dim {a.mscale_all_dim:g}",
    ]
    return flags


def load_flags(checkpoint_dir: Path) -> list[str]:
    """The flags that start training from a converted checkpoint: its weights only, no optimizer or RNG state."""
    return [f"--load {shlex.quote(str(checkpoint_dir.absolute()))}", "--ckpt-format torch_dist", "--finetune", "--no-load-optim", "--no-load-rng"]


def not_restored_by_checkpoint_args(args: argparse.Namespace) -> list[str]:
    """The flags of this model whose args Megatron-LM's `--use-checkpoint-args` would leave at defaults other
    than the model's values: what a run relying on it alone would silently get wrong."""
    return [
        FLAG_OF_ARG.get(name, "--" + name.replace("_", "-"))
        for name, default in MEGATRON_LM_DEFAULTS.items()
        if name not in RESTORED_BY_CHECKPOINT_ARGS and getattr(args, name, default) != default
    ]


def unnormalized_mla_query(args: argparse.Namespace) -> bool:
    """Multi-latent attention without a query bottleneck (q_lora_rank null: DeepSeek-V2-Lite) but with q/k layer
    norms (MLA's latent kv norm): the query is projected straight from the layer's input, which megatron-core 0.19
    cannot build (mconvert.verify.megatron_model.require_unnormalized_mla_query)."""
    return bool(getattr(args, "multi_latent_attention", False) and args.q_lora_rank is None and getattr(args, "qk_layernorm", False))


def pretrain_gpt_caveats(args: argparse.Namespace) -> list[str]:
    """What Megatron-LM's pretrain_gpt.py would build differently from these args: its model builder
    (gpt_builders.gpt_builder) passes GPTModel neither --rope-scaling-factor nor
    --rotary-seq-len-interpolation-factor, so GPTModel's defaults (8, none) apply; and what recent
    megatron-core builds differently (mconvert.verify.megatron_model.require_unnormalized_mla_query)."""
    caveats = []
    if args.use_rope_scaling and args.rope_scaling_factor != 8.0:
        caveats.append(
            f"pretrain_gpt.py builds GPTModel without --rope-scaling-factor, so with factor 8, not "
            f"{args.rope_scaling_factor:g}: pass rope_scaling_factor=args.rope_scaling_factor in its gpt_builder"
        )
    if args.rotary_seq_len_interpolation_factor is not None:
        caveats.append(
            "pretrain_gpt.py builds GPTModel without --rotary-seq-len-interpolation-factor, so without position "
            "interpolation: pass seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor in its gpt_builder"
        )
    if unnormalized_mla_query(args):
        caveats.append(
            "megatron-core 0.19 and later add a layer norm before linear_q_proj in multi-latent attention without "
            "--q-lora-rank, which this model does not have: train it with megatron-core 0.13 to 0.18"
        )
    return caveats


def args_script(args: argparse.Namespace, checkpoint_dir: Path) -> str:
    """megatron_args.sh: MODEL_ARGS (the model) and LOAD_ARGS (start from this checkpoint), for bash."""
    missed = not_restored_by_checkpoint_args(args)
    lines = ["# Megatron-LM flags for the converted model: pass \"${MODEL_ARGS[@]}\" \"${LOAD_ARGS[@]}\" to pretrain_gpt.py."]
    lines += [f"# Caveat: {caveat}." for caveat in pretrain_gpt_caveats(args)]
    if missed:
        lines.append(
            "# Pass MODEL_ARGS even with --use-checkpoint-args: Megatron-LM does not restore "
            + ", ".join(missed) + " from a checkpoint."
        )
    lines += ["MODEL_ARGS=("] + [f"    {flag}" for flag in megatron_flags(args)] + [")"]
    lines += ["LOAD_ARGS=("] + [f"    {flag}" for flag in load_flags(checkpoint_dir)] + [")"]
    return "\n".join(lines) + "\n"


def parallelism_from_args(args: argparse.Namespace) -> Parallelism:
    """The layout a checkpoint was saved with, as its args record it."""
    etp = getattr(args, "expert_tensor_parallel_size", None)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    return Parallelism(
        tp=tp,
        pp=getattr(args, "pipeline_model_parallel_size", 1) or 1,
        ep=getattr(args, "expert_model_parallel_size", 1) or 1,
        etp=None if etp in (None, tp) else etp,
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128) or 128,
        pipeline=PipelineSplit.from_args(args),
    )


def _moe_layers(freq: int | list[int], num_layers: int) -> tuple[bool, ...]:
    """Megatron's --moe-layer-freq: every k-th layer from layer 0 for an int k, else one 0/1 per layer.
    Megatron-LM parses the flag's string form ("([0]*1+[1]*3)") when it reads its command line (argparse
    `type=moe_freq_type`), so stored args hold the int or the list."""
    if isinstance(freq, str):
        raise ConversionError(f"args: moe_layer_freq is the string {freq!r}; Megatron-LM stores it parsed, as an int or a list")
    if isinstance(freq, int):
        return tuple(layer % freq == 0 for layer in range(num_layers))
    if len(freq) != num_layers:
        raise ConversionError(f"args: moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(bool(x) for x in freq)


def spec_from_args(
    args: argparse.Namespace, family: str = "", vocab_size: int | None = None, hf_config: dict[str, Any] | None = None
) -> ModelSpec:
    """The model that Megatron-LM `args` describe (the inverse of `megatron_args`), read as Megatron-LM reads
    them, defaults included. Args name no family: `family` is the caller's (see
    mconvert.mappings.family_for_spec). `vocab_size` is the real vocabulary when args lack it (Megatron-LM
    takes it from the tokenizer and may store only the padded size). Features no family has are errors."""

    def arg(name: str, default: Any = None) -> Any:
        return stored_arg(args, name, default)

    unsupported = [
        (arg("normalization", "LayerNorm") != "RMSNorm", f"normalization {arg('normalization', 'LayerNorm')} (RMSNorm is supported)"),
        (not arg("swiglu", False), "an MLP without SwiGLU"),
        (arg("position_embedding_type", "learned_absolute") != "rope", f"position embeddings '{arg('position_embedding_type', 'learned_absolute')}' (rope is supported)"),
        (arg("layernorm_zero_centered_gamma", False), "layernorm_1p"),
        (arg("rotary_interleaved", False), "interleaved rotary embeddings"),
        (arg("moe_router_score_function", "softmax") not in ("softmax", "sigmoid"), f"router score function '{arg('moe_router_score_function')}' (softmax and sigmoid are supported)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConversionError(f"args describe a model with {what}, which no supported family has")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
        if arg(name) is None:
            raise ConversionError(f"args: required argument '{name}' is missing")
    vocab = arg("vocab_size", vocab_size)
    if vocab is None:
        raise ConversionError("args record no vocab_size (only the padded size): pass --hf-config with the real vocabulary")
    heads = args.num_attention_heads
    params_dtype = arg("params_dtype")
    if not isinstance(params_dtype, torch.dtype):
        params_dtype = torch.bfloat16 if arg("bf16", False) else torch.float16 if arg("fp16", False) else torch.float32
    moe: MoESpec | None = None
    if arg("num_experts"):
        moe = MoESpec(
            num_experts=args.num_experts,
            top_k=arg("moe_router_topk", 2),
            ffn_hidden_size=arg("moe_ffn_hidden_size", args.ffn_hidden_size),
            moe_layers=_moe_layers(arg("moe_layer_freq", 1), args.num_layers),
            router_pre_softmax=arg("moe_router_pre_softmax", False),
            shared_expert_ffn_hidden_size=arg("moe_shared_expert_intermediate_size"),
            shared_expert_gate=arg("moe_shared_expert_gate", False),
            score_function=arg("moe_router_score_function", "softmax"),
            expert_bias=arg("moe_router_enable_expert_bias", False),
            topk_scaling_factor=arg("moe_router_topk_scaling_factor"),
            num_groups=arg("moe_router_num_groups"),
            group_topk=arg("moe_router_group_topk"),
            aux_loss_coeff=float(arg("moe_aux_loss_coeff", 0.0)),
            router_fp32=arg("moe_router_dtype") == "fp32",
        )
    mla: MLASpec | None = None
    if arg("multi_latent_attention", False):
        mla = MLASpec(
            q_lora_rank=arg("q_lora_rank"),
            kv_lora_rank=arg("kv_lora_rank", 32),
            qk_head_dim=arg("qk_head_dim", 128),
            qk_pos_emb_head_dim=arg("qk_pos_emb_head_dim", 64),
            v_head_dim=arg("v_head_dim", 128),
        )
    if mla is not None and arg("rope_type", "yarn") == "yarn" and float(arg("rotary_scaling_factor", 1.0)) != 1.0:
        rope: RopeScaling | None = RopeScaling(
            kind="yarn",
            factor=float(args.rotary_scaling_factor),
            mscale=float(arg("mscale", 1.0)),
            mscale_all_dim=float(arg("mscale_all_dim", 0.0)),
            **{field: type(fixed)(arg(field, fixed)) for field, fixed in MLA_YARN_FIXED.items()},
        )
    elif arg("use_rope_scaling", False):
        rope = RopeScaling(kind="llama3", factor=float(arg("rope_scaling_factor", 8.0)))
    elif arg("rotary_seq_len_interpolation_factor") is not None:
        rope = RopeScaling(kind="linear", factor=float(args.rotary_seq_len_interpolation_factor))
    else:
        rope = None
    linear_bias = bool(arg("add_bias_linear", True))
    window = arg("window_size")
    if window is not None and (window[1] != 0 or arg("window_attn_skip_freq") is not None):
        raise ConversionError(f"args: window_size {window} with window_attn_skip_freq {arg('window_attn_skip_freq')}: only a causal window on every layer is supported")
    return ModelSpec(
        family=family,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        # Megatron-LM ignores --num-query-groups unless --group-query-attention is given.
        num_query_groups=arg("num_query_groups", heads) if arg("group_query_attention", False) else heads,
        head_dim=mla.qk_head_dim + mla.qk_pos_emb_head_dim if mla else arg("kv_channels", args.hidden_size // heads),
        vocab_size=vocab,
        max_position_embeddings=args.max_position_embeddings,
        norm_eps=float(arg("layernorm_epsilon", 1e-5)),
        rope_theta=float(arg("rotary_base", 10000)),
        rope_scaling=rope,
        untie_embeddings=bool(arg("untie_embeddings_and_output_weights", False)),
        qkv_bias=linear_bias or bool(arg("add_qkv_bias", False)),
        linear_bias=linear_bias,
        # MLA's qk_layernorm is its latent norms, not q/k norms.
        qk_norm=bool(arg("qk_layernorm", False)) and mla is None,
        dtype=params_dtype,
        moe=moe,
        mla=mla,
        rotary_percent=float(arg("rotary_percent", 1.0)),
        mtp_layers=arg("mtp_num_layers", 0),
        sliding_window=window[0] + 1 if window is not None else None,
        attention_dropout=float(arg("attention_dropout", 0.1)),
        hf_config=dict(hf_config or {}),
    )
