"""Family: one architecture's knowledge, as data. A table of entries per scope, and its config rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Entry


def active(entries, spec: ModelSpec) -> tuple[Entry, ...]:
    """The entries that exist for `spec` (their `when` holds)."""
    return tuple(entry for entry in entries if entry.when is None or getattr(spec, entry.when))


# The scope of the table that holds a one-block layer's tensors (ModelSpec.layer_blocks), by its hybrid symbol.
BLOCK_SCOPES = {"M": "mamba", "*": "attention", "-": "dense_mlp", "E": "moe_mlp"}


def mtp_blocks(spec: ModelSpec) -> int:
    """The HF layers each MTP layer takes after the decoder's: one, or one a block (ModelSpec.mtp_blocks)."""
    return len(spec.mtp_blocks) if spec.mtp_blocks else 1


def mtp_position(spec: ModelSpec, layer: int) -> tuple[int, int]:
    """(the MTP layer, its block) of HF layer `layer`, one of those after the decoder's."""
    return divmod(layer - spec.num_layers, mtp_blocks(spec))


def layer_scopes(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    """The scopes of the table that HF layer `layer` is made of, in order: its one block where each HF layer is
    one (ModelSpec.layer_blocks, and the MTP layers' mtp_blocks); else its attention (gated delta-net's on
    linear-attention layers), the indexer where it runs one, and its MLP, with experts or dense, an MTP layer's as the
    decoder's last layer's. A `moe_mlp` scope brings the layer's experts."""
    if spec.layer_blocks is not None and layer >= spec.num_layers and spec.mtp_blocks is None:
        raise ConversionError("the checkpoint holds MTP layers whose blocks config.json does not name (num_nextn_predict_layers 0)")
    if spec.layer_blocks is not None:
        symbol = spec.layer_blocks[layer] if layer < spec.num_layers else spec.mtp_blocks[mtp_position(spec, layer)[1]]
        return (BLOCK_SCOPES[symbol],)
    layer = min(layer, spec.num_layers - 1)
    attention = ("linear_attention" if spec.layer_is_linear(layer) else "attention",) + (("indexer",) if spec.layer_has_indexer(layer) else ())
    return (*attention, "moe_mlp" if spec.layer_is_moe(layer) else "dense_mlp")


@dataclass(frozen=True)
class Layer:
    """The entries of one HF layer that exist for a model, in the order the plan takes them: an MTP layer's own
    tensors and its copies of model tensors (their HF names relative to `mtp_prefix`), the layer's blocks, then each
    expert's (HF names relative to `prefix`)."""

    prefix: str
    mtp_prefix: str
    mtp: tuple[Entry, ...]
    mtp_copies: tuple[Entry, ...]
    entries: tuple[Entry, ...]
    experts: tuple[Entry, ...]


@dataclass(frozen=True)
class Table:
    """Which HF tensors make which Megatron tensors, per scope.

    Megatron names are relative to their scope (`self_attention.linear_qkv.weight` within a layer); where
    they are stacked, padded and sharded is the converters' business. HF names of layer scopes are relative
    to `layer_prefix`; expert entries hold `{expert}`.

    `fused_experts` is the alternative HF layout that transformers v5 holds in memory (and writes with
    `save_original_format=False`): all experts of a layer in one 3-D tensor, `name[{expert}]` naming expert's
    slice of it. `fused_moe_mlp` replaces `moe_mlp` in that layout where the rest of the MoE layer is named
    differently there too (Mixtral's `block_sparse_moe.` is `mlp.` in memory); None where it is not.
    """

    model: tuple[Entry, ...]
    attention: tuple[Entry, ...]
    dense_mlp: tuple[Entry, ...]
    moe_mlp: tuple[Entry, ...] = ()
    experts: tuple[Entry, ...] = ()
    fused_experts: tuple[Entry, ...] = ()
    fused_moe_mlp: tuple[Entry, ...] | None = None
    # Whether the family's hub checkpoints store their experts fused, as mcore-to-hf then writes them (both
    # layouts are read).
    hub_experts_fused: bool = False
    layer_prefix: str = "model.layers.{layer}."
    # Multi-token prediction layers (the HF layers after the decoder's, named as layers are): their own
    # tensors beside a whole decoder layer, and `mtp_copies`, HF tensors of theirs that are copies of
    # model-scope ones Megatron shares (an MTP layer's embedding and output head). Where an MTP layer is several
    # blocks, each an HF layer (ModelSpec.mtp_blocks), `mtp` are its first block's and `mtp_end` its last block's.
    mtp: tuple[Entry, ...] = ()
    mtp_copies: tuple[Entry, ...] = ()
    mtp_end: tuple[Entry, ...] = ()
    # Where a family keeps its one MTP layer apart from the decoder's layers (Qwen3-Next's and Qwen3.5's `mtp.`):
    # its own tensors relative to this prefix, its decoder layer's to `<prefix>layers.0.`; empty for MTP layers
    # named as the layers after the decoder's.
    mtp_prefix: str = ""
    # Where a family numbers its MTP layers' HF layers apart from the decoder's, its own tensors among theirs
    # (Nemotron-H's `mtp.layers.{layer}.`, one block each); empty otherwise.
    mtp_layer_prefix: str = ""
    # The attention of layers that have gated delta-net linear attention (ModelSpec.linear_attention) in place
    # of `attention`.
    linear_attention: tuple[Entry, ...] = ()
    # The sparse-attention indexer of layers that run one (ModelSpec.sparse_attention), beside `attention`.
    indexer: tuple[Entry, ...] = ()
    # A Mamba-2 layer's tensors, norm included, for models whose HF layer is one block (ModelSpec.layer_blocks):
    # their `M` layers; `attention`, `dense_mlp` and `moe_mlp` (with the experts) are their other blocks, each with its norm.
    mamba: tuple[Entry, ...] = ()
    # Why the multi-token prediction layers an HF checkpoint holds are left out (Megatron-LM builds none beside
    # the model's attention variant); empty where they convert.
    mtp_left_out: str = ""
    # The config.json field (of its text_config where it has one) counting the multi-token prediction layers the
    # model was trained with; a checkpoint may hold fewer (transformers drops them when it saves a model).
    mtp_count_field: str = ""
    # HF tensors that a Megatron language-model checkpoint does not hold, by name prefix, with what they are (an
    # image-text checkpoint's vision tower): not converted, and the conversion's summary says so.
    left_out: tuple[tuple[str, str], ...] = ()
    # Prefixes of left-out tensors that mcore-to-hf copies unchanged from the original checkpoint that
    # `--hf-config` names (the vision tower, which the Megatron checkpoint has none of to give).
    copied_back: tuple[str, ...] = ()

    def layer(self, spec: ModelSpec, layer: int, fused_expert_layers: frozenset[int] | None = None) -> Layer:
        """What HF layer `layer` holds (layers from num_layers on: the MTP layers, each built as the decoder's last
        layer is, or their blocks, one an HF layer). `fused_expert_layers`: the layers whose experts the HF side holds
        fused, None for the hub's layout (a family whose HF models hold their experts only fused, gpt-oss, has no
        other; the hub keeps an MTP layer's experts one by one where it fuses the decoder's, Qwen3.5-MoE)."""
        mtp = layer >= spec.num_layers
        own, prefix = self.mtp_prefixes(spec.num_layers, layer - spec.num_layers) if mtp else ("", self.layer_prefix.format(layer=layer))
        block = mtp_position(spec, layer)[1] if mtp else None
        own_entries = (self.mtp if block == 0 else ()) + (self.mtp_end if block == mtp_blocks(spec) - 1 else ())
        hub_fused = self.hub_experts_fused and not mtp
        fused = not self.experts or (hub_fused if fused_expert_layers is None else layer in fused_expert_layers)
        scopes = layer_scopes(spec, layer)
        moe_mlp = self.fused_moe_mlp if fused and self.fused_moe_mlp is not None else self.moe_mlp
        entries = [entry for scope in scopes for entry in (moe_mlp if scope == "moe_mlp" else getattr(self, scope))]
        return Layer(
            prefix=prefix,
            mtp_prefix=own,
            mtp=active(own_entries, spec),
            mtp_copies=active(self.mtp_copies, spec) if block == 0 else (),
            entries=active(entries, spec),
            experts=active(self.fused_experts if fused else self.experts, spec) if "moe_mlp" in scopes else (),
        )

    def under(self, prefix: str, **changes: Any) -> Table:
        """This table with its model's and layers' HF names one level down, under `prefix`: the language model of an
        image-text checkpoint that keeps it under `language_model.` (Kimi-K2.5's, Gemma 3's)."""
        model = tuple(dataclasses.replace(entry, hf=prefix + entry.hf) for entry in self.model)
        return dataclasses.replace(self, model=model, layer_prefix=prefix + self.layer_prefix, **changes)

    def mtp_prefixes(self, num_layers: int, mtp_layer: int) -> tuple[str, str]:
        """(the prefix of MTP layer `mtp_layer`'s own tensors, that of its decoder layer's); of its block
        `mtp_layer` where each block is an HF layer (mtp_layer_prefix)."""
        if self.mtp_layer_prefix:
            return (self.mtp_layer_prefix.format(layer=mtp_layer),) * 2
        if self.mtp_prefix:
            return self.mtp_prefix, f"{self.mtp_prefix}layers.{mtp_layer}."
        prefix = self.layer_prefix.format(layer=num_layers + mtp_layer)
        return prefix, prefix

    def left_out_by(self, name: str) -> str | None:
        """What the left-out HF tensor `name` is part of; None for a tensor the table converts or refuses."""
        return next((what for prefix, what in self.left_out if name.startswith(prefix)), None)


@dataclass(frozen=True)
class Family:
    name: str
    # HF config.json `model_type` values this family reads.
    model_types: tuple[str, ...]
    # Prefixes of `--model-size` values (Megatron-LM's and ours) that name this family.
    model_sizes: tuple[str, ...]
    table: Table
    read_config: Callable[[dict[str, Any]], ModelSpec]
    write_config: Callable[[ModelSpec], dict[str, Any]]
    # The transformers classes this family maps (config.json's `architectures`), each with its model_type: a
    # checkpoint that ships its own code (`auto_map`) under another model_type is read as the class it names.
    architectures: tuple[tuple[str, str], ...] = ()

    def hf_model_type(self, config: dict[str, Any]) -> str | None:
        """The transformers model_type whose model `config` describes: its own where the family reads it, else
        that of the class its `architectures` names (a checkpoint shipping its own code of a known class)."""
        model_type = config.get("model_type")
        if model_type in self.model_types:
            return model_type
        classes = dict(self.architectures)
        return next((classes[name] for name in config.get("architectures") or () if name in classes), model_type)
