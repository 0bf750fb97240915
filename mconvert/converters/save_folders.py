"""Where a training run keeps its Megatron save and its model's HF config, told from the folders and files the tool
that trained it writes, so that `mcore-to-hf --load-dir` takes the run's top folder:

- verl (its Megatron checkpoint manager): `<top>/global_step_<N>/actor/` holding `dist_ckpt/` (megatron-core's
  dist_checkpointing save of the model's sharded state dict, optimizer and RNG beside it) or Megatron-LM's layout,
  and `huggingface/` (the HF config and tokenizer, written by rank 0); `<top>/latest_checkpointed_iteration.txt`
  holds the step N (not an `iter_` number).
- NeMo-RL (its checkpoint manager and Megatron policy): `<top>/step_<N>/policy/weights/`, a Megatron-Bridge save
  (`iter_0000000/` with its `run_config.yaml`), beside `step_<N>/config.yaml` (`policy.model_name`).
- Megatron-Bridge: `iter_<N>/run_config.yaml`, whose `checkpoint.hf_source_path` or `model.hf_model_id` names the
  HF model the run started from (what Megatron-Bridge's own HF export templates its config on).
- ms-swift: `args.json` beside `iter_*` (`model_dir`, or `model`: the HF model the run started from).
- slime and Megatron-LM: Megatron-LM's layout, whose stored args describe the model (slime's also name the HF
  model, `hf_checkpoint`: see `config_in_args`); without args, the config comes from `--hf-config` alone.

Each record names an HF folder or hub id; the folder must be on this machine (a hub id is found in the hub cache or
downloaded, as `--hf-config`'s are)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert.errors import ConversionError
from mconvert.hub import resolve_hf_dir
from mconvert.mcore.checkpoint import TRACKER_FILE, iteration_dir

RUN_CONFIG = "run_config.yaml"  # Megatron-Bridge's, in each iteration folder
SWIFT_ARGS = "args.json"  # ms-swift's, in the save folder


@dataclass(frozen=True)
class RunSave:
    """A run's Megatron save: the folder `open_megatron_checkpoint` reads (with `iteration`), the tool whose folders
    were recognised, and the HF config folder its records name (None where they name none)."""

    load_dir: Path
    iteration: int | None
    tool: str
    config_dir: Path | None = None
    config_from: str = ""  # the record that named `config_dir`, for messages


def numbered(top: Path, prefix: str) -> dict[int, Path]:
    """`top`'s folders `<prefix><N>`, by N."""
    return {int(match.group(1)): path for path in top.iterdir() if path.is_dir() and (match := re.fullmatch(rf"{prefix}(\d+)", path.name))}


def step_folder(top: Path, prefix: str, iteration: int | None, tool: str) -> Path:
    """The step folder of a run's top folder: `--iteration N`'s, else the one the tracker file names (verl writes the
    step there), else the last."""
    steps = numbered(top, prefix)
    if iteration is not None:
        if iteration not in steps:
            raise ConversionError(f"--iteration {iteration}: {top} holds no {prefix}{iteration} ({tool} steps saved: {', '.join(map(str, sorted(steps)))})")
        return steps[iteration]
    tracker = top / TRACKER_FILE
    if tracker.exists():
        text = tracker.read_text(errors="replace").strip()
        if text.isdigit() and int(text) in steps:
            return steps[int(text)]
    return steps[max(steps)]


def hf_folder(reference: str, record: str) -> Path:
    """The local HF folder a run's record names (a path, or a hub id found in the cache or downloaded)."""
    try:
        return resolve_hf_dir(reference, record, weights=False)
    except ConversionError as error:
        raise ConversionError(f"{error} (pass --hf-config: the HF folder of the model the run trained)") from None


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML record as Megatron-Bridge and NeMo-RL write them (plain data: objects as `_target_` mappings)."""
    try:
        import yaml
    except ImportError:
        raise ConversionError(f"{path}: reading it needs PyYAML (pip install pyyaml), or pass --hf-config") from None
    try:
        loaded = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path}: not plain YAML ({str(error).splitlines()[0]})") from None
    return loaded if isinstance(loaded, dict) else {}


def bridge_record(directory: Path) -> tuple[str, str] | None:
    """(HF model, record) a Megatron-Bridge iteration folder's run_config.yaml names, or None."""
    path = directory / RUN_CONFIG
    if not path.exists():
        return None
    run_config = read_yaml(path)
    for section, field in (("checkpoint", "hf_source_path"), ("model", "hf_model_id")):
        value = (run_config.get(section) or {}).get(field)
        if isinstance(value, str) and value:
            return value, f"{path}'s {section}.{field}"
    return None


def swift_record(load_dir: Path) -> tuple[str, str] | None:
    """(HF model, record) ms-swift's args.json names, or None."""
    path = load_dir / SWIFT_ARGS
    if not path.exists():
        return None
    try:
        args = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path}: not JSON ({error})") from None
    for field in ("model_dir", "model"):
        value = args.get(field) if isinstance(args, dict) else None
        if isinstance(value, str) and value and (field == "model" or Path(value).is_dir()):
            return value, f"{path}'s {field}"
    return None


def config_in_args(args: argparse.Namespace | None) -> tuple[str, str] | None:
    """(HF model, record) stored Megatron-LM args name: slime's `--hf-checkpoint`."""
    value = getattr(args, "hf_checkpoint", None)
    return (value, "the checkpoint's args' hf_checkpoint (slime)") if isinstance(value, str) and value else None


def named_config(save: RunSave, record: tuple[str, str] | None) -> RunSave:
    """`save` with the HF config folder `record` (HF model, where it is named) names, unless it has one already."""
    if record is None or save.config_dir is not None:
        return save
    reference, where = record
    return RunSave(save.load_dir, save.iteration, save.tool, hf_folder(reference, where), where)


def find_run_save(top: str | Path, iteration: int | None = None, config: bool = True) -> RunSave:
    """The Megatron save under a run's folder `top` and, with `config`, the HF config folder its records name."""
    with_config = named_config if config else (lambda save, record: save)
    top = Path(top)
    if not top.is_dir():
        raise ConversionError(f"{top}: not a directory")
    if numbered(top, "global_step_"):
        top, iteration = step_folder(top, "global_step_", iteration, "verl") / "actor", None
        if not top.is_dir():
            raise ConversionError(f"{top}: missing; a verl step folder keeps the Megatron save under actor/")
    elif (top / "actor").is_dir() and not (top / TRACKER_FILE).exists():
        top = top / "actor"
    if (top / "dist_ckpt").is_dir() or (top / "huggingface").is_dir():  # verl's actor folder
        load_dir = top / "dist_ckpt" if (top / "dist_ckpt").is_dir() else top
        hf = top / "huggingface"
        if load_dir == top and any(hf.glob("*.safetensors")):
            raise ConversionError(f"{top}: verl saved this step's model as HF weights, in {hf}: that folder is the export")
        found = (str(hf), f"verl's {hf}") if (hf / "config.json").exists() else None
        save = with_config(RunSave(load_dir, iteration if load_dir == top else None, "verl"), found)
        return with_config(save, bridge_record(iteration_dir(load_dir, save.iteration)) if config else None)
    nemo_config = None
    if numbered(top, "step_"):
        top, iteration = step_folder(top, "step_", iteration, "NeMo-RL"), None
    if (top / "policy" / "weights").is_dir():  # a NeMo-RL step folder
        nemo_config = top / "config.yaml"
        top = top / "policy" / "weights"
    tool = "NeMo-RL" if nemo_config is not None else "Megatron-LM"
    save = RunSave(top, iteration, tool)
    directory = iteration_dir(top, iteration)
    if (directory / RUN_CONFIG).exists():
        save = with_config(RunSave(top, iteration, tool if nemo_config is not None else "Megatron-Bridge"), bridge_record(directory) if config else None)
    elif (top / SWIFT_ARGS).exists():
        save = with_config(RunSave(top, iteration, "ms-swift"), swift_record(top) if config else None)
    if config and nemo_config is not None and nemo_config.exists():
        model = (read_yaml(nemo_config).get("policy") or {}).get("model_name")
        save = with_config(save, (model, f"{nemo_config}'s policy.model_name") if isinstance(model, str) and model else None)
    return save
