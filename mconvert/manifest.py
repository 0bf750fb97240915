"""The manifest every conversion writes into its output: the sha256 of every file, in `sha256sum`'s format
(so `sha256sum -c mconvert.sha256` checks it too), and the check that re-reads the files against it."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mconvert.errors import ConversionError

MANIFEST = "mconvert.sha256"
_BLOCK = 16 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(block):
            digest.update(view[:count])  # hashlib lets go of the GIL here: files hash in parallel threads
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST
    )


def _hash_all(directory: Path, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda name: sha256_of(directory / name), names))


def write_manifest(directory: Path) -> None:
    """Hash every file under `directory` into its manifest."""
    names = _files(directory)
    lines = [f"{digest}  {name}\n" for name, digest in zip(names, _hash_all(directory, names))]
    (directory / MANIFEST).write_text("".join(lines))


def read_manifest(directory: Path) -> dict[str, str]:
    """The manifest of `directory`: file -> sha256."""
    path = directory / MANIFEST
    if not path.exists():
        raise ConversionError(f"{directory}: no {MANIFEST} (not written by mconvert, or by a version before manifests)")
    entries = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise ConversionError(f"{path}: line {number} is not '<sha256>  <file>'")
        entries[name] = digest
    return entries


def check_manifest(directory: Path) -> list[str]:
    """Re-read every file of `directory` against its manifest: the problems found (a file changed, missing or
    not in the manifest), none when all match."""
    expected = read_manifest(directory)
    present = set(_files(directory))
    problems = [f"{name}: missing" for name in sorted(set(expected) - present)]
    problems += [f"{name}: not in {MANIFEST}" for name in sorted(present - set(expected))]
    names = sorted(set(expected) & present)
    for name, digest in zip(names, _hash_all(directory, names)):
        if digest != expected[name]:
            problems.append(f"{name}: sha256 {digest}, {MANIFEST} says {expected[name]}")
    return problems
