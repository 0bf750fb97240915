"""How Megatron-Core splits a model over ranks: tensor, pipeline, expert and expert-tensor parallel sizes, the
pipeline split of the decoder layers, the vocabulary padding that TP implies, and the model class whose keys the
checkpoint has. Checked against a model before anything is written, each refusal naming the flag."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import QKVInterleave


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

    def stage_layers(self, pp: int, num_layers: int) -> list[int]:
        """The decoder layers of each stage, virtual stages included (check first): a layout's, else by the
        first/last stage counts and evenly otherwise."""
        if self.layout is not None:
            return [stage.count("t") for stage in self.stages()]
        first, last = self.first_stage_layers, self.last_stage_layers
        if pp == 1:
            return [num_layers]
        ends = [count for count in (first, last) if count is not None]
        middle = pp - len(ends)
        each = (num_layers - sum(ends)) // middle if middle else 0
        return ([first] if first is not None else []) + [each] * middle + ([last] if last is not None else [])

    @classmethod
    def of_stages(cls, stage_layers: list[int], pp: int, mtp_layers: int) -> "PipelineSplit":
        """The split whose stages hold these decoder layer counts: the even split where it is one, else the
        layout that says it (the MTP layers on the last stage)."""
        if len(stage_layers) == pp and len(set(stage_layers)) == 1:
            return cls()
        stages = ["t" * count for count in stage_layers]
        stages[0], stages[-1] = "E" + stages[0], stages[-1] + "m" * mtp_layers + "L"
        return cls(layout="|".join(stages))

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


MODEL_CLASSES = ("gpt", "hybrid")


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # Expert tensor parallelism; None means Megatron's default, the same as tp.
    etp: int | None = None
    make_vocab_size_divisible_by: int = 128
    pipeline: PipelineSplit = PipelineSplit()
    # The Megatron-Core model class the checkpoint is for: "gpt" (GPTModel) or "hybrid" (HybridModel, whose keys
    # give each sub-block of a layer its own layer and whose pattern splits the pipeline stages: mcore.hybrid).
    model_class: str = "gpt"

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def validate(self, spec: ModelSpec) -> None:
        """Reject sizes Megatron cannot shard this model by, naming the flag, before anything is written."""
        for flag, size in (("--tp", self.tp), ("--pp", self.pp), ("--ep", self.ep), ("--etp", self.expert_tp)):
            if size < 1:
                raise ConversionError(f"{flag} {size}: must be at least 1")
        checks = [("--tp", self.tp, "num_attention_heads", spec.num_attention_heads)]
        if self.tp <= spec.num_query_groups:
            checks.append(("--tp", self.tp, "num_key_value_heads (query groups)", spec.num_query_groups))
        elif spec.qk_norm_across_heads:
            # Above the query groups, ranks share a group's key, which the key norm across heads would have to split.
            raise ConversionError(
                f"--tp {self.tp}: above num_key_value_heads ({spec.num_query_groups}), which bounds the tensor "
                "parallelism of q/k norms across heads"
            )
        elif self.tp % spec.num_query_groups:
            raise ConversionError(
                f"--tp {self.tp}: neither divides nor is a multiple of num_key_value_heads ({spec.num_query_groups}), as "
                "megatron-core requires"
            )
        else:
            # Above the query groups, megatron-core splits the fused QKV's rows evenly still (each rank gathers
            # the group it reads): the rows must divide.
            checks.append(("--tp", self.tp, "the fused QKV's rows", QKVInterleave.fused_rows(spec)))
        if spec.moe is None or not all(spec.moe.moe_layers):
            checks.append(("--tp", self.tp, "intermediate_size", spec.ffn_hidden_size))
        if spec.mamba is not None:
            checks += [("--tp", self.tp, "mamba_num_heads", spec.mamba.num_heads), ("--tp", self.tp, "n_groups", spec.mamba.num_groups)]
        if spec.linear_attention is not None:
            checks += [
                ("--tp", self.tp, "linear_num_key_heads", spec.linear_attention.key_heads),
                ("--tp", self.tp, "linear_num_value_heads", spec.linear_attention.value_heads),
            ]
        if spec.moe is not None:
            checks += [
                ("--ep", self.ep, "the number of experts", spec.moe.num_experts),
                ("--etp", self.expert_tp, "the experts' intermediate size", spec.moe.ffn_hidden_size),
            ]
            if spec.linear_bias and self.expert_tp != 1:
                # megatron-core's TransformerConfig: "Bias in Moe is only supported when ETP==1".
                raise ConversionError(f"--etp {self.expert_tp}: megatron-core supports experts with biases only at --etp 1")
            if spec.moe.shared_expert_ffn_hidden_size:
                checks.append(("--tp", self.tp, "shared_expert_intermediate_size", spec.moe.shared_expert_ffn_hidden_size))
        elif self.ep != 1 or self.etp not in (None, 1, self.tp):
            raise ConversionError(f"--ep/--etp: the model has no experts ({spec.family} is dense)")
        for flag, size, what, value in checks:
            if value % size:
                raise ConversionError(f"{flag} {size} does not divide {what} ({value})")
        if self.model_class not in MODEL_CLASSES:
            raise ConversionError(f"--model-class {self.model_class}: one of {', '.join(MODEL_CLASSES)}")
        if spec.layer_blocks is not None and self.model_class != "hybrid":
            raise ConversionError(
                f"--model-class {self.model_class}: {spec.family}'s layers are single blocks (Mamba, attention, MLP or MoE) "
                "that only HybridModel holds: use --model-class hybrid"
            )
        if self.model_class == "hybrid":
            # Megatron-LM's validate_args: a hybrid layer pattern's `|` separators are its pipeline split.
            for flag, used in (("--account-for-embedding-in-pipeline-split", self.pipeline.embedding_counts),
                               ("--account-for-loss-in-pipeline-split", self.pipeline.loss_counts)):
                if used:
                    raise ConversionError(f"{flag}: not with --model-class hybrid, whose layer pattern splits the stages")
        self.pipeline.check(self.pp, spec.num_layers, spec.mtp_layers)


def padded_vocab_size(vocab_size: int, par: Parallelism) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP (extra rows are zero)."""
    multiple = par.make_vocab_size_divisible_by * par.tp
    return math.ceil(vocab_size / multiple) * multiple

