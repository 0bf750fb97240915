"""What transformers' class for a config holds, kept between exports (the check of converters/whole_export.py): a
file per config under the user's cache directory, so that an export of a config checked before imports neither torch
nor transformers (their import and the class's build take seconds; the conversion of a small model, about one).

An entry is keyed by everything that decides it: the written config.json (canonical JSON), the installed transformers'
and torch's versions (read from their package records, not imported), mconvert's version and the entry's own format
(VERDICT_FORMAT, raised when what an entry holds or how the class is picked changes). The file's name is a hash of
the key and the file holds the key itself, compared whole when read, and a hash of the verdict: an entry that cannot
be read, does not parse, is another key's or whose verdict does not match its hash is ignored and made again, never
trusted (whole_export.knows also refuses a verdict not as class_verdict makes one). Entries are written whole (a
temporary file renamed into place), so a reader sees an old entry or a new one, never a part.

Where: $MCONVERT_CACHE_DIR, else $XDG_CACHE_HOME/mconvert, else ~/.cache/mconvert; MCONVERT_CACHE_DIR set empty turns
the cache off. Removing the directory clears it (as after changing transformers' code in place: an editable install
keeps its version). A directory that cannot be written leaves the check as without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import mconvert

# Raised whenever an entry's fields or their meaning change (whole_export.class_verdict, transformers_model).
VERDICT_FORMAT = 1
CACHE_ENV = "MCONVERT_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where the entries are, or None where the cache is turned off."""
    if CACHE_ENV in os.environ:
        return Path(os.environ[CACHE_ENV]) if os.environ[CACHE_ENV] else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mconvert"


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value).encode()).hexdigest()


def verdict_key(config: dict[str, Any]) -> dict[str, Any] | None:
    """The key of the class check of `config`, or None where the versions that decide it are not known (a package
    without its records) or the cache is off."""
    if cache_dir() is None:
        return None
    try:
        versions = {name: importlib.metadata.version(name) for name in ("transformers", "torch")}
    except importlib.metadata.PackageNotFoundError:
        return None
    return {"format": VERDICT_FORMAT, "mconvert": mconvert.__version__, **versions, "config": config}


def entry_path(key: dict[str, Any]) -> Path:
    return cache_dir() / f"class-{digest(key)[:32]}.json"


def read_verdict(key: dict[str, Any] | None) -> dict[str, Any] | None:
    """The verdict kept for `key`; None where there is none, or it is unreadable or another key's."""
    if key is None:
        return None
    try:
        entry = json.loads(entry_path(key).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or canonical(entry.get("key")) != canonical(key) or entry.get("sha256") != digest(entry.get("verdict")):
        return None
    return entry["verdict"]


def write_verdict(key: dict[str, Any] | None, verdict: dict[str, Any]) -> None:
    """Keep `verdict` for `key`, whole or not at all; a cache that cannot be written is no error of the export."""
    if key is None:
        return
    path = entry_path(key)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(descriptor, "w") as f:
                f.write(canonical({"key": key, "verdict": verdict, "sha256": digest(verdict)}))
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
