"""HF model references: a local directory, or a hub id (`Qwen/Qwen2.5-7B`) resolved through huggingface_hub,
from its cache (`HF_HUB_CACHE`, `HF_HOME`) first and by downloading only the files a conversion reads when
online. huggingface_hub is imported only for hub ids, so conversion of local directories does not need it."""

from __future__ import annotations

import os
from pathlib import Path

from mconvert.errors import ConversionError
from mconvert.json_files import read_weight_map

# Files of an HF model directory besides its weights and config.json that describe how to use it (copied
# along on export, read by verify --prompts).
HF_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    # An image-text checkpoint's input processing (Qwen3.5).
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
# What is fetched from a hub repository: never pickled `*.bin` weights, nor the `original/` copies some carry.
CONFIG_FILES = ("config.json", *HF_SIDE_FILES)
WEIGHT_FILES = ("model.safetensors.index.json", "*.safetensors")
_TRUE = {"1", "ON", "YES", "TRUE"}


def missing_files(directory: Path, weights: bool) -> list[str]:
    """The files a conversion needs that `directory` lacks: config.json and, with `weights`, the safetensors
    files (every shard its index names)."""
    missing = [] if (directory / "config.json").exists() else ["config.json"]
    if weights:
        index = directory / "model.safetensors.index.json"
        if index.exists():
            shards = sorted(set(read_weight_map(index).values()))
            missing += [shard for shard in shards if not (directory / shard).exists()]
        elif not any(directory.glob("*.safetensors")):
            missing.append("*.safetensors")
    return missing


def _offline() -> bool:
    # Read now, not when huggingface_hub was imported, so that the environment of this call decides.
    return any(os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_hf_dir(
    reference: str | os.PathLike, flag: str, *, weights: bool = True, revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The local directory of the HF model `reference` given by `flag`: the directory itself when it exists,
    else the hub repository of that id at `revision`, from the cache (`cache_dir`, by default the hub's) or
    downloaded (only config, tokenizer and, with `weights`, safetensors files) unless HF_HUB_OFFLINE is set."""
    path = Path(reference)
    if path.is_dir():
        if revision is not None:
            raise ConversionError(f"--revision {revision}: {flag} {reference} is a local directory, not a hub id")
        return path
    repo_id = str(reference)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConversionError(f"{flag} {reference}: no such directory (nor a hub id)") from None
    patterns = list(CONFIG_FILES + (WEIGHT_FILES if weights else ()))
    cache = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
    at = f" at revision {revision}" if revision else ""
    try:
        cached = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns, local_files_only=True
        ))
    except LocalEntryNotFoundError:
        cached, missing = None, ["the repository"]
    else:
        missing = missing_files(cached, weights)
        if not missing:
            return cached
    if _offline():
        raise ConversionError(
            f"{flag} {reference}: not a local directory, and HF_HUB_OFFLINE is set while the hub cache {cache} "
            f"lacks {', '.join(missing)} of {repo_id}{at} (download it with `hf download {repo_id}{' --revision ' + revision if revision else ''}` where online)"
        )
    try:
        downloaded = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns
        ))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ConversionError(f"{flag} {reference}: not a local directory, and the hub gave no {repo_id}{at} ({str(e).splitlines()[0]})") from None
    missing = missing_files(downloaded, weights)
    if missing:
        raise ConversionError(f"{flag} {reference}: the hub repository {repo_id}{at} has no {', '.join(missing)}")
    return downloaded
