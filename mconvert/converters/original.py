"""The original checkpoint `mcore-to-hf --hf-config` names, where it holds weights: how it lays out what the export
writes (its experts fused or one by one), and what the export copies back from it unchanged."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mconvert.errors import ConversionError
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.formats.quantized import fp8_block_size
from mconvert.formats.safetensors import INDEX_FILE, SINGLE_FILE, StoredTensor
from mconvert.mappings.family import Family


def original_tensors(hf_config_dir: str | os.PathLike | None, reference: dict[str, Any] | None) -> HFCheckpoint | None:
    """The --hf-config checkpoint's tensors (headers only, FP8 ones by the block size its config names); None where it
    holds no weights (a config alone)."""
    if hf_config_dir is None or not any(Path(hf_config_dir).glob("*.safetensors")):
        return None
    return HFCheckpoint(hf_config_dir, fp8_block_size(reference))


def copied_back(family: Family, hf_config_dir: str | os.PathLike | None, original: HFCheckpoint | None) -> dict[str, StoredTensor]:
    """What the original checkpoint holds beside the model that its family copies back unchanged (an image-text
    checkpoint's vision tower: a Megatron GPT checkpoint holds none), from the `--hf-config` directory, which must
    then be the original checkpoint's (`original`: its tensors, original_tensors')."""
    prefixes = family.table.copied_back
    if not prefixes:
        return {}
    what = ", ".join(family.table.left_out_by(prefix) or prefix for prefix in prefixes)
    directory = Path(hf_config_dir) if hf_config_dir is not None else None
    if original is None or not any((directory / name).exists() for name in (INDEX_FILE, SINGLE_FILE)):
        raise ConversionError(
            f"--hf-config {hf_config_dir}: a {family.name} checkpoint holds {what} beside the language model, which the "
            "Megatron checkpoint does not: name the original checkpoint's directory, whose weights are copied from"
        )
    found = {name: stored for name, stored in original.tensors.items() if name.startswith(prefixes)}
    if not found:
        raise ConversionError(f"--hf-config {hf_config_dir}: no tensor of {what} ({', '.join(p + '*' for p in prefixes)}) to copy back")
    return found
