"""The JSON files an HF checkpoint carries (config.json, the safetensors index), read within a stated bound: a file
is read whole only up to a size that no real one approaches, so that memory never follows a size a corrupt or
hostile file claims. Base layer: the hub's look at a cached snapshot reads the index too."""

from __future__ import annotations

import json
from pathlib import Path

from mconvert.errors import ConversionError

# config.json is kilobytes; the largest safetensors index on the hub (a trillion-parameter MoE with FP8 scales, about
# 140,000 tensors) is about 11 MB.
JSON_FILE_BYTES = 100 * 10**6


def read_json_bytes(path: Path) -> bytes:
    """The bytes of a JSON file a checkpoint carries, if it is no larger than any real one."""
    size = path.stat().st_size
    if size > JSON_FILE_BYTES:
        raise ConversionError(f"{path}: {size} bytes, more than any config or index holds (at most {JSON_FILE_BYTES})")
    return path.read_bytes()


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; every shard a plain file name in the index's directory."""
    try:
        weight_map = json.loads(read_json_bytes(index))["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ConversionError(f"{index}: not a safetensors index (no readable 'weight_map': {e!r})") from None
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{index}: 'weight_map' is not an object of tensor names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ConversionError(f"{index}: tensor '{name}' names shard {file!r}, not a file beside the index")
    return weight_map
