"""hf-to-mcore's `--layout megatron-bridge`: an HF image-text checkpoint (Qwen3.5, Qwen3-VL) written as Megatron-Bridge 0.6.2
saves its vision-language model (`Qwen3VLModel`), so that a Megatron-Bridge run loads it
(`checkpoint.pretrained_checkpoint`, or `checkpoint.load` to resume):

- the language model: the family's plan, megatron-core's GPTModel keys, under `language_model.`;
- the vision tower under `vision_model.`, by the names and the per-head QKV order mcore-to-hf reads such a save with
  (mconvert.converters.bridge_saves: one table both ways), its blocks (and Qwen3-VL's deepstack mergers) stacked;
- `_extra_state` objects for every module owning a tensor (and attention's core), as the language model's;
- in `release/`: `common.pt` as Megatron-Bridge's (its checkpoint version and sharded state dict metadata, no
  Megatron-LM args), `run_config.yaml` with what its checkpoint loading reads (`model.tensor_model_parallel_size`,
  `model.pipeline_model_parallel_size`, `checkpoint.save_rng`, `save_optim`, `fully_parallel_save`) and the HF
  model it came from (`model.hf_model_id`, what mcore-to-hf and Megatron-Bridge's own HF export read); the tracker
  file says `release`.

torch_dist stores global tensors, and the vision tower lives on the first pipeline stage whole, so the files hold
the same tensors at any TP and PP: the sizes are recorded for Megatron-Bridge's check that a resumed run's match."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mconvert.converters.bridge_saves import BLOCKS, FUSED_QKV, LANGUAGE_MODEL, VISION_MODEL, interleave_qkv, stacked_prefix, vision_keys
from mconvert.converters.plan import Plan
from mconvert.dtypes import cast
from mconvert.errors import ConversionError
from mconvert.formats.dcp_writer import DCPWriter
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.mcore.layout import EXTRA_STATE_ONLY_MODULES, extra_state_key
from mconvert.mcore.parallelism import Parallelism

MEGATRON_LM, MEGATRON_BRIDGE = "megatron-lm", "megatron-bridge"
LAYOUTS = (MEGATRON_LM, MEGATRON_BRIDGE)
RUN_CONFIG = "run_config.yaml"
# What Megatron-Bridge's save passes megatron-core as the sharded state dict's metadata without a distributed
# optimizer (training/checkpointing.py `_build_sharded_state_dict_metadata`), kept in common.pt.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def prefixed(plan: Plan, prefix: str = LANGUAGE_MODEL) -> Plan:
    """`plan` writing every key under `prefix`."""
    pieces = tuple(dataclasses.replace(piece, keys=tuple(prefix + key for key in piece.keys)) for piece in plan.pieces)
    return dataclasses.replace(plan, shapes={prefix + key: shape for key, shape in plan.shapes.items()}, pieces=pieces,
                               extra_state_keys=tuple(prefix + key for key in plan.extra_state_keys))


@dataclass(frozen=True)
class VisionTower:
    """The vision tower's keys as Megatron-Bridge saves them, each with its global shape and its HF tensors."""

    keys: dict[str, tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    heads: int
    dtype: np.dtype

    @classmethod
    def of(cls, plan: Plan, hf: HFCheckpoint, source: str) -> VisionTower:
        prefixes, config = plan.family.table.copied_back, plan.spec.hf_config or {}
        heads = (config.get("vision_config") or {}).get("num_heads")
        names = [name for name in hf.tensors if prefixes and name.startswith(prefixes[0])]
        if not names or not isinstance(heads, int):
            raise ConversionError(f"--layout {MEGATRON_BRIDGE}: {source} holds no vision tower with a vision_config "
                                  f"(num_heads) to write beside the language model ({plan.family.name})")
        try:
            keys = vision_keys(names, prefixes[0])
        except ConversionError as error:
            raise ConversionError(f"{source}: {error}") from None
        shapes = {}
        for key, sources in keys.items():
            inner = {hf.tensors[name].shape for name in sources}
            if len(inner) != 1:
                raise ConversionError(f"{source}: the vision blocks' tensors of '{key}' differ in shape: {sorted(inner)}")
            shapes[key] = ((len(sources),) if stacked_prefix(key) else ()) + tuple(inner.pop())
        return cls(keys, shapes, heads, plan.dtype)

    def extra_state_keys(self) -> list[str]:
        """A module's `_extra_state` key for each module owning a tensor, and attention's core, per block (per
        numbered module: a deepstack merger's as a block's)."""
        blocks = VISION_MODEL + BLOCKS
        modules = {key.rsplit(".", 1)[0] for key in self.keys}
        modules |= {blocks + module for scope, module in EXTRA_STATE_ONLY_MODULES.items() if any(key.startswith(blocks + scope) for key in self.keys)}
        counts = {stacked_prefix(key): shape[0] for key, shape in self.shapes.items() if stacked_prefix(key)}
        found = []
        for module in sorted(modules):
            count = counts.get(stacked_prefix(module + "."))
            numbered = [((number,), (count,)) for number in range(count)] if count else [((), ())]
            found += [extra_state_key(module, offsets, leading) for offsets, leading in numbered]
        return found

    def declare(self, writer: DCPWriter) -> None:
        for key, shape in self.shapes.items():
            writer.declare(key, shape, self.dtype)

    def write(self, writer: DCPWriter, hf: HFCheckpoint) -> None:
        """Every vision tensor, one HF tensor at a time (a block's or deepstack merger's slice of a stacked key)."""
        for key, sources in self.keys.items():
            stacked = stacked_prefix(key) is not None
            for block, name in enumerate(sources):
                tensor = hf.read(name)
                if key.removeprefix(VISION_MODEL + BLOCKS) in FUSED_QKV:
                    tensor = interleave_qkv(tensor, self.heads)
                tensor = np.ascontiguousarray(cast(tensor, self.dtype))
                writer.write_chunk(key, ((block,) if stacked else ()) + (0,) * tensor.ndim, tensor[None] if stacked else tensor)


def run_config(load_dir: Path, parallelism: Parallelism) -> str:
    """run_config.yaml: the fields Megatron-Bridge's checkpoint loading and mcore-to-hf read. Without the model
    provider's `_target_`: Megatron-Bridge builds the model from the HF checkpoint (its AutoBridge), not from here."""
    sections = {
        "model": {
            "hf_model_id": str(load_dir.resolve()),
            "tensor_model_parallel_size": parallelism.tp,
            "pipeline_model_parallel_size": parallelism.pp,
            "expert_model_parallel_size": parallelism.ep,
        },
        "checkpoint": {"save_optim": False, "save_rng": False, "fully_parallel_save": True},
    }
    # JSON's scalars are YAML's.
    return "".join(f"{section}:\n" + "".join(f"  {field}: {json.dumps(value)}\n" for field, value in fields.items())
                   for section, fields in sections.items())


def next_steps(save_dir: Path, parallelism: Parallelism, family: str) -> str:
    return (f"next: in Megatron-Bridge (a recipe of its {family} vision-language model, model from the same HF checkpoint, TP "
            f"{parallelism.tp} PP {parallelism.pp}):\n  checkpoint.pretrained_checkpoint={save_dir}\n"
            f"  mconvert mcore-to-hf --load-dir {save_dir} --save-dir OUT   # back to HF, vision tower included")
