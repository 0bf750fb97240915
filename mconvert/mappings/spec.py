"""ModelSpec: what a model is, independent of how HF or Megatron lay it out, read from an HF config.json.

Fields that both sides need live here; each family module reads its own HF fields into it. Anything a
config says that Megatron cannot express is an error, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.mappings.mamba_spec import MambaSpec
from mconvert.mappings.rope import RopeScaling, hub_rope_scaling, read_rope

DTYPES = {name: dtypes.BY_NAME[name] for name in ("bfloat16", "float16", "float32")}


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
    # "softmax" or "sigmoid" (DeepSeek-V3, GLM-4.5: sigmoid scores, top-k renormalised when k > 1).
    score_function: str = "softmax"
    # A learned per-expert bias added to the scores to choose experts, not to weigh them
    # (DeepSeek-V3's e_score_correction_bias).
    expert_bias: bool = False
    # The routing weights' multiplier (routed_scaling_factor); None for none.
    topk_scaling_factor: float | None = None
    # Group-limited routing: experts in `num_groups` groups, tokens routed within the best `group_topk`.
    num_groups: int | None = None
    group_topk: int | None = None
    # The load-balancing loss's weight in training (HF `router_aux_loss_coef`); no effect on the weights.
    aux_loss_coeff: float = 0.0
    # Routed experts that read and write a narrower width than the model's, projected into it and back around them
    # (Nemotron 3 Super's latent MoE, megatron-core's moe_latent_size); None: the experts work at the model's width.
    latent_size: int | None = None
    # Router logits and routing weights computed in fp32 whatever the model's dtype, as transformers does for
    # DeepSeek-V2/V3 and GLM-4.5 (Megatron's `moe_router_dtype` fp32): in bf16, near-equal expert scores
    # otherwise round to ties and tokens go to other experts. How the model computes, not what it is: HF
    # configs cannot say it, so a Megatron checkpoint trained either way converts back to the same model.
    router_fp32: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3): queries through a rank-`q_lora_rank` bottleneck (or one
    projection when None), keys and values from one compressed latent of rank `kv_lora_rank` plus a rope part
    shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int  # the part of each query/key head without rope
    qk_pos_emb_head_dim: int  # the rope part
    v_head_dim: int


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated delta-net linear attention (Qwen3-Next, Qwen3.5) on the layers `layers` marks, full attention on
    the others. Each of `value_heads` heads reads the key head `head * key_heads // value_heads` (values
    grouped by key head); q, k and v pass through one causal convolution of `conv_kernel` taps per channel."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # True where layer i has linear attention, False where it has full attention.
    layers: tuple[bool, ...]

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class SparseAttentionSpec:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5.1): a lightning indexer scores every earlier token for
    each query (`index_heads` heads of `index_head_dim`, their first qk_pos_emb_head_dim dims rotated) and
    multi-latent attention attends to the best `topk` only. Layers that `indexer_layers` marks False run no
    indexer and reuse the top-k of the last layer that did (GLM's shared layers)."""

    index_heads: int
    index_head_dim: int
    topk: int
    # Whether the indexer's rope rotates interleaved pairs (GLM-5.1) or the two halves (DeepSeek-V3.2).
    rope_interleaved: bool
    indexer_layers: tuple[bool, ...]
    # The indexer's key norm (a LayerNorm with bias) has its own epsilon in transformers: 1e-6.
    key_norm_eps: float = 1e-6


def dsa_indexer_layers(topk_freq: int, skip_topk_offset: int, num_layers: int) -> tuple[bool, ...]:
    """Which layers run their own sparse-attention indexer under megatron-core's dsa_indexer_topk_freq and
    dsa_indexer_skip_topk_offset (its is_dsa_skip_topk_layer: 1-numbered layer n runs one where
    max(n - max(offset, 1), 0) % freq == 0)."""
    offset = max(skip_topk_offset, 1)
    return tuple(max(n - offset, 0) % topk_freq == 0 for n in range(1, num_layers + 1))


def shared_top_k_schedule(indexer_layers: tuple[bool, ...]) -> tuple[int, int] | None:
    """megatron-core's (dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) that run an indexer on exactly the
    layers `indexer_layers` marks; None where no pair does."""
    layers = len(indexer_layers)
    return next(
        ((freq, offset) for freq in range(1, layers + 1) for offset in range(1, layers + 1)
         if dsa_indexer_layers(freq, offset, layers) == tuple(indexer_layers)),
        None,
    )


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
    dtype: np.dtype
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    # The fraction of each head's dimensions that rope rotates (GLM-4.5's partial_rotary_factor).
    rotary_percent: float = 1.0
    # Rope rotates each pair of neighbouring dims (2i, 2i+1) of a head (ERNIE 4.5's), not dim i with dim i + d/2.
    rotary_interleaved: bool = False
    # Multi-token prediction layers the checkpoint holds (DeepSeek-V3's and GLM-4.5's extra layers after the
    # decoder). What a checkpoint holds, not what its config says: transformers drops them when it saves.
    mtp_layers: int = field(default=0, compare=False)
    # Tokens each position attends to, itself included (HF `sliding_window`); None for full attention.
    sliding_window: int | None = None
    # Which layers attend within the window, where only some do (gpt-oss's `layer_types`); None: all of them.
    sliding_layers: tuple[bool, ...] | None = None
    # Megatron's softmax_type: "learnable" adds a learned per-head logit to every softmax (gpt-oss's sinks).
    softmax_type: str = "vanilla"
    # The gated MLP: SwiGLU ("silu"), GeGLU with GELU's tanh approximation ("gelu_tanh": Gemma's), or "quick_gelu"
    # (x * sigmoid(1.702 x)) on the gate with the linear half offset by `glu_linear_offset` and both halves clamped
    # at `activation_clamp` (gpt-oss); or the MLP without a gate, "squared_relu" (relu(x)^2, Megatron's --squared-relu: Nemotron-H).
    activation: str = "silu"
    glu_linear_offset: float = 0.0
    activation_clamp: float | None = None
    # Gated delta-net layers beside the full-attention ones; None: full attention everywhere.
    linear_attention: LinearAttentionSpec | None = None
    # DeepSeek Sparse Attention's indexer beside multi-latent attention; None: dense attention.
    sparse_attention: SparseAttentionSpec | None = None
    # Full attention's output multiplied by sigmoid of a gate that the query projection also makes, one per
    # head dimension (Qwen3-Next's q_proj holds each head's query and gate side by side).
    attention_output_gate: bool = False
    # The q/k norms normalise each token's query (key) over all heads of the layer together, one weight per channel
    # of them (MiniMax-M2's qk_norm_type 'per_layer'), not each head alone.
    qk_norm_across_heads: bool = False
    # Where the layer's norms are: before its attention and its MLP, on each one's input (Llama's); after them, each
    # on the sublayer's output before the residual add (OLMo 2's post_attention_layernorm and
    # post_feedforward_layernorm, and none before); or both (Gemma's four norms a layer).
    norms_before_sublayers: bool = True
    norms_after_sublayers: bool = False
    # Every RMSNorm multiplies by 1 + w (Megatron's layernorm_zero_centered_gamma, `--apply-layernorm-1p`).
    zero_centered_norms: bool = False
    # The rope theta of the sliding-window layers where theirs is their own, unscaled (Gemma 3's rope_local_base_freq);
    # None: every layer has the model's rope.
    sliding_window_rope_theta: float | None = None
    # The embeddings multiplied by sqrt(hidden_size), rounded to the weights' dtype as transformers rounds it (Gemma's).
    embeddings_scaled: bool = False
    # Attention scores scaled by 1/sqrt of this rather than of head_dim (Gemma's query_pre_attn_scalar); None: head_dim.
    attention_scale_dim: int | None = None
    # Dropout on attention probabilities in training (HF `attention_dropout`); no effect on the weights.
    attention_dropout: float = 0.0
    # Models whose HF layer is one block (Nemotron-H): each layer's megatron-core hybrid symbol (`M` Mamba, `*`
    # attention, `-` MLP, `E` MoE); None where every HF layer is attention then an MLP.
    layer_blocks: str | None = None
    # Its MTP layers' blocks, each an HF layer of its own after the decoder's (Nemotron 3 Super's `*E`); None: none.
    mtp_blocks: str | None = field(default=None, compare=False)
    # The Mamba-2 mixers of the `M` layers.
    mamba: MambaSpec | None = None
    # Attention's position embeddings: "rope", or "none" (Nemotron-H's, beside Mamba layers that see the order).
    position_embeddings: str = "rope"
    # What megatron-core computes differently from transformers for this model, where no setting reconciles them
    # (each conversion says so; the verifier measures it).
    computed_differently: tuple[str, ...] = field(default=(), compare=False)
    # The config.json the spec was read from, kept so mcore-to-hf can restore fields Megatron has no use for.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def uniform_layers(self) -> bool:
        """Megatron stacks layers along one axis only when all layers have the same modules."""
        shared_top_k = self.sparse_attention is not None and not all(self.sparse_attention.indexer_layers)
        uniform_moe = self.moe is None or len(set(self.moe.moe_layers)) == 1
        return uniform_moe and self.linear_attention is None and not shared_top_k and self.layer_blocks is None

    def layer_has_indexer(self, layer: int) -> bool:
        return self.sparse_attention is not None and self.sparse_attention.indexer_layers[layer]

    def layer_is_linear(self, layer: int) -> bool:
        return self.linear_attention is not None and self.linear_attention.layers[layer]

    def layer_is_moe(self, layer: int) -> bool:
        return self.moe is not None and self.moe.moe_layers[layer]

    @property
    def q_low_rank(self) -> bool:
        """Multi-latent attention with a query bottleneck (q_a_proj, q_b_proj)."""
        return self.mla is not None and self.mla.q_lora_rank is not None

    @property
    def q_full_rank(self) -> bool:
        """Multi-latent attention with one query projection (q_proj)."""
        return self.mla is not None and self.mla.q_lora_rank is None

    @property
    def router_expert_bias(self) -> bool:
        return self.moe is not None and self.moe.expert_bias

    @property
    def moe_latent(self) -> bool:
        return self.moe is not None and self.moe.latent_size is not None

    @property
    def attention_sinks(self) -> bool:
        return self.softmax_type == "learnable"


# Counts that the conversion walks one by one (layers, and experts in each): bounded far above any model's, so that
# a corrupt config.json ends in an error rather than a loop over 10^12 layers (found by scripts/fuzz).
MOST = {"num_hidden_layers": 10_000, "num_experts": 65_536, "num_local_experts": 65_536, "n_routed_experts": 65_536}


def require(config: dict[str, Any], name: str, source: str) -> Any:
    """A size or count the config must give: a positive integer (at most MOST's bound for the counts it names)."""
    value = config.get(name)
    if value is None:
        raise ConversionError(f"{source}: required field '{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConversionError(f"{source}: field '{name}' is {value!r}, not a positive integer")
    if value > MOST.get(name, value):
        raise ConversionError(f"{source}: field '{name}' is {value}, more than any model has (at most {MOST[name]})")
    return value


def read_dtype(config: dict[str, Any]) -> np.dtype:
    name = config.get("dtype", config.get("torch_dtype")) or "float32"
    if name not in DTYPES:
        raise ConversionError(f"config.json: dtype '{name}' is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def read_sliding_window(config: dict[str, Any], source: str) -> int | None:
    """The attention window of every layer, as transformers applies `sliding_window`: not when
    `use_sliding_window` is false (Qwen configs carry a window they do not use), and per layer where
    `layer_types` (or Qwen's `max_window_layers`, from which transformers derives them) say so. Megatron
    applies one window to all layers: a mix of windowed and full layers is an error."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    kinds = config.get("layer_types")
    if kinds is None and config.get("max_window_layers") is not None:
        first_windowed = config["max_window_layers"]
        kinds = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(config.get("num_hidden_layers", 0))]
    if kinds is not None:
        if "sliding_attention" not in kinds:
            return None
        if "full_attention" in kinds:
            raise ConversionError(f"{source}: sliding-window attention on some layers only ({kinds.count('sliding_attention')} of {len(kinds)}) is not supported")
    return int(window)


def read_dense_spec(
    config: dict[str, Any],
    family: str,
    source: str = "config.json",
    default_theta: float = 10000.0,
    applies_sliding_window: bool = True,
    **overrides: Any,
) -> ModelSpec:
    """The fields every supported family shares, read the way transformers reads them.
    `applies_sliding_window`: whether the model's transformers class honours `sliding_window` (Llama's
    ignores it)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{source}: hidden_act '{act}' is not supported (SwiGLU with silu is)")
    max_positions = config.get("max_position_embeddings", 4096)
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
        sliding_window=read_sliding_window(config, source) if applies_sliding_window else None,
        attention_dropout=float(config.get("attention_dropout", 0.0)),
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
    # The weights written are never quantized: a source's quantization_config does not describe them.
    dropped = ("rope_parameters", "dtype", "torch_dtype", "quantization_config")
    config = {k: v for k, v in spec.hf_config.items() if k not in dropped}
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
        rope_scaling=hub_rope_scaling(spec.rope_scaling),
        tie_word_embeddings=not spec.untie_embeddings,
        attention_dropout=spec.attention_dropout,
        torch_dtype=dtype_name,
    )
    if spec.sliding_window is not None:
        # Mistral reads `sliding_window`; Qwen also needs the switch and every layer typed as windowed.
        config.update(
            sliding_window=spec.sliding_window,
            use_sliding_window=True,
            layer_types=["sliding_attention"] * spec.num_layers,
        )
        config.pop("max_window_layers", None)
    return config
