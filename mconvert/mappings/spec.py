"""ModelSpec: what a model is, independent of how HF or Megatron lay it out, read from an HF config.json.

Fields that both sides need live here; each family module reads its own HF fields into it. Anything a
config says that Megatron cannot express is an error, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mconvert.errors import ConversionError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling that Megatron can express.

    kind "llama3": Megatron-Core's `--use-rope-scaling` (factor free; the other three numbers are fixed there).
    kind "linear": position interpolation, Megatron's `--rotary-seq-len-interpolation-factor`.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    ffn_hidden_size: int
    # True where layer i has routed experts, False where it has a dense MLP.
    moe_layers: tuple[bool, ...]
    # Softmax over all experts before top-k (no renormalisation), as Qwen2-MoE's norm_topk_prob=False.
    router_pre_softmax: bool
    shared_expert_ffn_hidden_size: int | None = None
    shared_expert_gate: bool = False


@dataclass(frozen=True)
class ModelSpec:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    untie_embeddings: bool
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    moe: MoESpec | None = None
    # The config.json the spec was read from, kept so the way back can restore fields Megatron has no use for.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def uniform_layers(self) -> bool:
        """Megatron stacks layers along one axis only when all layers have the same modules."""
        return self.moe is None or len(set(self.moe.moe_layers)) == 1

    def layer_is_moe(self, layer: int) -> bool:
        return self.moe is not None and self.moe.moe_layers[layer]


def require(config: dict[str, Any], name: str, source: str) -> Any:
    """A size or count the config must give: a positive integer."""
    value = config.get(name)
    if value is None:
        raise ConversionError(f"{source}: required field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConversionError(f"{source}: field '{name}' is {value!r}, not a positive integer")
    return value


def read_rope(config: dict[str, Any], source: str, default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """Rope theta and scaling from either config style: hub configs' `rope_theta` + `rope_scaling`, or
    transformers v5's `rope_parameters` (which holds rope_theta and rope_type together). `default_theta` is
    what transformers uses for the family when the config names none."""
    params = config.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", config.get("rope_theta"))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = config.get("rope_theta")
        scaling = config.get("rope_scaling")
    if theta is None:
        theta = default_theta
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        rope = RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
        fixed = RopeScaling(kind="llama3", factor=rope.factor)
        if rope != fixed:
            # Megatron-Core's llama3 scaling takes only the factor; the rest are constants in its code.
            raise ConversionError(
                f"{source}: rope_scaling {scaling} differs from what Megatron-Core supports "
                f"(low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)"
            )
        return float(theta), rope
    if kind == "linear":
        return float(theta), RopeScaling(kind="linear", factor=float(scaling["factor"]))
    raise ConversionError(f"{source}: rope scaling type '{kind}' is not supported (llama3 and linear are)")


def read_dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("dtype", config.get("torch_dtype")) or "float32"
    if name not in DTYPES:
        raise ConversionError(f"config.json: dtype '{name}' is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def read_dense_spec(
    config: dict[str, Any], family: str, source: str = "config.json", default_theta: float = 10000.0, **overrides: Any
) -> ModelSpec:
    """The fields every supported family shares, read the way transformers reads them."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{source}: hidden_act '{act}' is not supported (SwiGLU with silu is)")
    window = config.get("sliding_window")
    max_positions = config.get("max_position_embeddings", 4096)
    # Qwen configs carry a window with use_sliding_window=false; Mistral's applies whenever it is set.
    window_used = config.get("use_sliding_window", window is not None and window < max_positions)
    if window_used:
        raise ConversionError(f"{source}: sliding-window attention (sliding_window={window}) is not supported")
    heads = require(config, "num_attention_heads", source)
    hidden = require(config, "hidden_size", source)
    head_dim = config.get("head_dim") or hidden // heads
    theta, scaling = read_rope(config, source, default_theta)
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        # Megatron's --add-bias-linear puts biases on every linear layer or on none.
        raise ConversionError(
            f"{source}: attention_bias={attention_bias} with mlp_bias={mlp_bias} cannot be expressed in Megatron"
        )
    fields: dict[str, Any] = dict(
        family=family,
        num_layers=require(config, "num_hidden_layers", source),
        hidden_size=hidden,
        ffn_hidden_size=require(config, "intermediate_size", source),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab_size=require(config, "vocab_size", source),
        max_position_embeddings=max_positions,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        untie_embeddings=not config.get("tie_word_embeddings", False),
        qkv_bias=attention_bias,
        linear_bias=attention_bias,
        qk_norm=False,
        dtype=read_dtype(config),
        hf_config=dict(config),
    )
    fields.update(overrides)
    if fields["num_attention_heads"] % fields["num_query_groups"]:
        raise ConversionError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{fields['num_query_groups']}"
        )
    return ModelSpec(**fields)


def write_dense_config(spec: ModelSpec, model_type: str, architecture: str) -> dict[str, Any]:
    """An HF config.json for `spec`, in the hub style that transformers v4 and v5 both read. Fields of the
    config the spec was read from that Megatron has no use for (token ids, ...) are kept."""
    dtype_name = next(name for name, dtype in DTYPES.items() if dtype == spec.dtype)
    config = {k: v for k, v in spec.hf_config.items() if k not in ("rope_parameters", "dtype", "torch_dtype")}
    if spec.rope_scaling is None:
        rope_scaling = None
    elif spec.rope_scaling.kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": spec.rope_scaling.factor}
    else:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": spec.rope_scaling.factor,
            "low_freq_factor": spec.rope_scaling.low_freq_factor,
            "high_freq_factor": spec.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": spec.rope_scaling.original_max_position_embeddings,
        }
    config.update(
        architectures=[architecture],
        model_type=model_type,
        hidden_act="silu",
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.head_dim,
        num_hidden_layers=spec.num_layers,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=not spec.untie_embeddings,
        torch_dtype=dtype_name,
    )
    return config
