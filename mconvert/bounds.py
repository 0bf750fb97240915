"""Reading what a checkpoint's files claim within stated bounds: a file read whole is read only up to a size
that no real one approaches, so that memory never follows a size a corrupt or hostile file claims."""

from __future__ import annotations

from pathlib import Path

from mconvert.errors import ConversionError

# config.json is kilobytes; the largest safetensors index on the hub (a trillion-parameter MoE with FP8 scales, about
# 140,000 tensors) is about 11 MB.
JSON_FILE_BYTES = 100 * 10**6
# The safetensors library's own limit on a header (MAX_HEADER_SIZE).
SAFETENSORS_HEADER_BYTES = 100 * 10**6


def read_json_bytes(path: Path) -> bytes:
    """The bytes of a JSON file a checkpoint carries, if it is no larger than any real one."""
    size = path.stat().st_size
    if size > JSON_FILE_BYTES:
        raise ConversionError(f"{path}: {size} bytes, more than any config or index holds (at most {JSON_FILE_BYTES})")
    return path.read_bytes()
