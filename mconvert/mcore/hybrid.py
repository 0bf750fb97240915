"""Megatron-Core's HybridModel layout: every sub-block its own layer, named by one symbol of
`--hybrid-layer-pattern` (megatron-core 0.19's hybrid_layer_allocation). A GPT layer i is a pair of hybrid
layers: its attention (`*`, MLA `+`, gated delta-net `G`, sparse attention `D`) then its MLP (`-` dense, `E`
MoE). A model whose HF layers are one block each (ModelSpec.layer_blocks: Nemotron-H, with Mamba layers `M`)
has HF layer i as hybrid layer i. Keys are per layer, never stacked: `decoder.layers.<h>.<name>` with the same
names within a layer as GPTModel's Transformer Engine spec; the final norm is `decoder.final_norm`; an MTP layer's sub-blocks sit in
its own small stack, `mtp.layers.<m>.mtp_model_layer.layers.<j>.<name>`. `|` separates pipeline stages and
`/` starts each MTP layer's pattern."""

from __future__ import annotations

from mconvert.errors import ConversionError
from mconvert.mappings.family import mtp_position
from mconvert.mappings.spec import ModelSpec

ATTENTION, MLA, GATED_DELTA_NET, SPARSE_ATTENTION = "*", "+", "G", "D"
MLP, MOE = "-", "E"
MAMBA = "M"
PIPE, MTP_SEPARATOR = "|", "/"
ATTENTION_SYMBOLS = (ATTENTION, MLA, GATED_DELTA_NET, SPARSE_ATTENTION)
MLP_SYMBOLS = (MLP, MOE)

# GPTModel's final norm and HybridModel's.
GPT_FINAL_NORM = "decoder.final_layernorm."
HYBRID_FINAL_NORM = "decoder.final_norm."
# Within a GPT layer, the names of its attention sub-block; everything else is its MLP's.
ATTENTION_SCOPES = ("input_layernorm.", "self_attention.")


def layer_pair(spec: ModelSpec, layer: int) -> str:
    """The two symbols of GPT layer `layer` (an MTP layer is built like the decoder's last)."""
    layer = min(layer, spec.num_layers - 1)
    if spec.layer_is_linear(layer):
        attention = GATED_DELTA_NET
    elif spec.sparse_attention is not None:
        attention = SPARSE_ATTENTION
    elif spec.mla is not None:
        attention = MLA
    else:
        attention = ATTENTION
    return attention + (MOE if spec.layer_is_moe(layer) else MLP)


def blocks_per_layer(spec: ModelSpec) -> int:
    """Hybrid layers per HF layer: 1 where each HF layer is one block, else 2 (a GPT layer's attention and MLP)."""
    return 1 if spec.layer_blocks is not None else 2


def hybrid_pattern(spec: ModelSpec, stage_layers: list[int]) -> str:
    """The unified pattern of `spec`'s layers split into pipeline stages of `stage_layers` HF layers each,
    then one `/`-led pattern per MTP layer."""
    if spec.layer_blocks is not None:
        return restaged(spec.layer_blocks + (MTP_SEPARATOR + (spec.mtp_blocks or "")) * spec.mtp_layers, stage_layers, 1)
    pairs = "".join(layer_pair(spec, layer) for layer in range(spec.num_layers))
    return restaged(pairs + (MTP_SEPARATOR + layer_pair(spec, spec.num_layers)) * spec.mtp_layers, stage_layers)


def restaged(pattern: str, stage_layers: list[int], width: int = 2) -> str:
    """`pattern` with its `|` placed anew: pipeline stages of `stage_layers` HF layers each, every one `width` hybrid
    layers (2: a GPT layer's attention-MLP pair)."""
    main, mtp = split_pattern(pattern)
    starts = [width * sum(stage_layers[:stage]) for stage in range(len(stage_layers) + 1)]
    return PIPE.join(main[start:end] for start, end in zip(starts, starts[1:])) + "".join(MTP_SEPARATOR + part for part in mtp)


def split_pattern(pattern: str) -> tuple[str, list[str]]:
    """(the main pattern without pipes, each MTP layer's pattern)."""
    main, *mtp = pattern.split(MTP_SEPARATOR)
    return main.replace(PIPE, ""), mtp


def has_mamba(pattern: str) -> bool:
    """Whether the pattern has Mamba layers: then each of its layers is one block of an HF layer (Nemotron-H's),
    not half of a GPT layer."""
    return MAMBA in split_pattern(pattern)[0]


def gpt_layers_of(pattern: str, source: str = "args") -> tuple[str, list[str]]:
    """The pattern as GPT layers: (the main pattern, the MTP layers' patterns), each a run of attention-then-MLP
    pairs, else a one-line error naming the first position that is not."""
    main, mtp = split_pattern(pattern)
    for where, part in [("", main)] + [(f" (MTP layer {m})", p) for m, p in enumerate(mtp)]:
        for h, symbol in enumerate(part):
            expected = ATTENTION_SYMBOLS if h % 2 == 0 else MLP_SYMBOLS
            if symbol not in expected:
                raise ConversionError(
                    f"{source}: hybrid_layer_pattern {pattern!r}{where}: layer {h} is '{symbol}' where a GPT layer's "
                    f"{'attention' if h % 2 == 0 else 'MLP'} ({' '.join(expected)}) is expected"
                )
        if len(part) % 2:
            raise ConversionError(f"{source}: hybrid_layer_pattern {pattern!r}{where}: the last attention has no MLP after it")
    if any(part != mtp[0] for part in mtp) or any(len(part) != 2 for part in mtp):
        raise ConversionError(f"{source}: hybrid_layer_pattern {pattern!r}: each MTP layer must be one attention and one MLP")
    return main, mtp


def sub_block(name: str) -> int:
    """0 for a name in a GPT layer's attention, 1 for one in its MLP."""
    return 0 if name.startswith(ATTENTION_SCOPES) else 1


def hybrid_layer_key(name: str, layer: int, spec: ModelSpec) -> str:
    """The HybridModel key of HF layer `layer`'s tensor `name` (layers from num_layers on: the MTP layers')."""
    if spec.layer_blocks is not None and layer >= spec.num_layers:
        mtp_layer, block = mtp_position(spec, layer)
        return f"mtp.layers.{mtp_layer}.mtp_model_layer.layers.{block}.{name}"
    if spec.layer_blocks is not None:
        return f"decoder.layers.{layer}.{name}"
    if layer >= spec.num_layers:
        return f"mtp.layers.{layer - spec.num_layers}.mtp_model_layer.layers.{sub_block(name)}.{name}"
    return f"decoder.layers.{2 * layer + sub_block(name)}.{name}"


def hybrid_model_key(key: str) -> str:
    """A model-level key (embedding, final norm, output layer) as HybridModel names it."""
    return HYBRID_FINAL_NORM + key[len(GPT_FINAL_NORM) :] if key.startswith(GPT_FINAL_NORM) else key


def per_hybrid_layer(values: list, pattern: str, fill: object = 0) -> list:
    """A per-GPT-layer list (an attention schedule) spread over the main pattern's hybrid layers: each value at
    its layer's attention, `fill` at the MLPs, as megatron-core indexes such lists by layer number."""
    main, _ = split_pattern(pattern)
    return [values[h // 2] if h % 2 == 0 else fill for h in range(len(main))]


def per_gpt_layer(values: list, pattern: str) -> list:
    """The inverse of per_hybrid_layer: the values at the attention positions."""
    main, _ = split_pattern(pattern)
    if len(values) != len(main):
        raise ConversionError(f"args: a per-layer list of {len(values)} entries for the {len(main)} layers of {pattern!r}")
    return values[0::2]
