"""Megatron-Core's `torch_dist` checkpoint directory: a DCP directory (mconvert.formats.dcp) plus Megatron's
own files.

    <dir>/latest_checkpointed_iteration.txt   "release" or an iteration number
    <dir>/release/metadata.json                which backends wrote it
    <dir>/release/common.pt                    torch.save({"args": Namespace, ...}): the model's description
    <dir>/release/.metadata                    DCP metadata: every key's global shape and stored chunks
    <dir>/release/__0_0.distcp                 the chunks, each a torch.save'd tensor, back to back
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.pickles import load_megatron_file
from mconvert.formats.torch_save import saved_bytes, tensor_pickle

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# megatron-core's checkpoint_version for the current QKV layout.
CHECKPOINT_VERSION = 3.0
# What a module's `_extra_state` holds when Transformer Engine runs without FP8 (a list of one empty uint8 tensor), as
# torch.save writes it.
EMPTY_EXTRA_STATE = saved_bytes([tensor_pickle(dtypes.uint8, (0,))], [b""])


def write_common(release_dir: Path, args: argparse.Namespace | None, content_metadata: dict | None = None) -> None:
    """metadata.json and common.pt: what megatron-core reads besides the DCP files. `args` holds plain values and
    dtypes (mconvert.formats.pickle_writer), as megatron_args makes them; None for a Megatron-Bridge save, which
    keeps the sharded state dict's `content_metadata` instead (megatron-core's dist_checkpointing.save)."""
    (release_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))
    common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    common |= {"args": args} if args is not None else {"content_metadata": content_metadata}
    (release_dir / "common.pt").write_bytes(saved_bytes(common, folder="common"))


def write_tracker(checkpoint_dir: Path, iteration: int | None = None) -> None:
    """The tracker file naming the release directory, or iteration `iteration`'s (`iteration_name`)."""
    (checkpoint_dir / TRACKER_FILE).write_text(RELEASE if iteration is None else str(iteration))


def iteration_name(iteration: int) -> str:
    """Megatron-LM's directory of an iteration's checkpoint."""
    return f"iter_{iteration:07d}"


def _load_common(path: Path) -> dict:
    """common.pt's dict, running nothing it names (see mconvert.converters.pickles)."""
    common = load_megatron_file(path, str(path))
    if not isinstance(common, dict):
        raise ConversionError(f"{path}: holds a {type(common).__name__}, not a dict")
    return common


def read_args(release_dir: Path) -> argparse.Namespace:
    """The Megatron-LM args a checkpoint was saved with; an error when it stores none."""
    args = read_common_args(release_dir)
    if args is None:
        raise ConversionError(f"{release_dir}: no Megatron args stored with the checkpoint (no 'args' in its common state)")
    return args


def iteration_dir(load_dir: Path, iteration: int | None = None) -> Path:
    """The directory of one saved iteration: `--iteration N`'s `iter_000000N`, else the one the tracker file
    names (`release` or a number), else `load_dir` itself when it holds the checkpoint files directly."""
    if not load_dir.is_dir():
        raise ConversionError(f"{load_dir}: not a directory")
    if iteration is not None:
        directory = load_dir / iteration_name(iteration)
        if not directory.is_dir():
            saved = sorted(p.name for p in load_dir.glob("iter_*")) + ([RELEASE] if (load_dir / RELEASE).is_dir() else [])
            raise ConversionError(f"--iteration {iteration}: {directory} does not exist (saved: {', '.join(saved) or 'none'})")
        return directory
    tracker = load_dir / TRACKER_FILE
    if tracker.exists():
        # Megatron-LM writes `release` or an iteration number: the first bytes tell; the rest is not read.
        with open(tracker, "rb") as f:
            text = f.read(64).decode("ascii", errors="replace").strip()
        if text == RELEASE:
            return load_dir / RELEASE
        if not (text.isascii() and text.isdigit() and len(text) <= 18):
            raise ConversionError(f"{tracker}: holds {text[:20]!r}, neither 'release' nor an iteration number")
        return load_dir / iteration_name(int(text))
    return load_dir


def read_common_args(release_dir: Path, dcp: DCPCheckpoint | None = None) -> argparse.Namespace | None:
    """The Megatron-LM args a checkpoint was saved with, or None when it has none (megatron-core's
    `dist_checkpointing.save` of a bare model's state). megatron-core up to 0.16 keeps the common state in
    `common.pt`; later ones store it as a `common_state` object among the DCP shards instead."""
    if (release_dir / "common.pt").exists():
        return _load_common(release_dir / "common.pt").get("args")
    if dcp is None:
        if not (release_dir / ".metadata").exists():
            raise ConversionError(f"{release_dir}: not a torch_dist checkpoint (no common.pt, no .metadata)")
        dcp = DCPCheckpoint(release_dir)
    for key in dcp.object_keys:
        if key.split("/")[0] != "common_state":
            continue
        common = dcp.read_object(key)
        if isinstance(common, list) and common:
            common = common[0]  # Megatron-LM 0.19's training saves hold it in a one-element list
        args = common.get("args") if isinstance(common, dict) else None
        if isinstance(args, argparse.Namespace):
            return args
    return None
