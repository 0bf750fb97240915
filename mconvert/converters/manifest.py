"""The manifest every conversion writes into its output: the sha256 of every file, in `sha256sum`'s format
(so `sha256sum -c mconvert.sha256` checks it too), and the check that re-reads the files against it.

A large file is hashed while it is written, by a thread that reads just behind the writer from the page
cache, on the core the conversion leaves idle: torch_dist's data file, written front to back, and the HF
safetensors files, filled out of order but mostly front to back, hashed as far as they are filled from the
start. The others (small, or written by several processes) are hashed when the manifest is written."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from mconvert.errors import ConversionError

MANIFEST = "mconvert.sha256"
# Bytes of a file mapped at a time to hash them.
_WINDOW = 64 << 20
# How long the following hasher waits for the writer when it has caught up.
_FOLLOW_POLL_S = 0.05
# Digests of files hashed while written, by absolute path: (size, mtime_ns, sha256).
_hashed_while_written: dict[Path, tuple[int, int, str]] = {}
_hashed_lock = threading.Lock()


def _hash_window(digest, fd: int, start: int, end: int) -> int:
    """Add the bytes of file `fd` from `start` to `end`, or to the end of the window that starts there, to
    `digest`; return where it stopped. The bytes are hashed in place through a memory map of the page cache:
    reading them into a buffer cost the kernel a copy of each, a third of the hashing's CPU time."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    stop = min(end, base + _WINDOW)
    with mmap.mmap(fd, stop - base, prot=mmap.PROT_READ, offset=base) as window, memoryview(window) as view:
        digest.update(view[start - base :])  # hashlib lets go of the GIL here: files hash in parallel threads
    return stop


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        position, size = 0, os.fstat(f.fileno()).st_size
        while position < size:
            position = _hash_window(digest, f.fileno(), position, size)
    return digest.hexdigest()


@contextmanager
def hashed_while_written(path: Path, written: Callable[[], int] | None = None, closed: threading.Event | None = None) -> Iterator[None]:
    """Hash `path` while the body of the `with` writes it: appending to it (never seeking back), or, with
    `written`, filling it in another order (a file already at its full size, or records whose data is
    copied in after them), of which `written()` says how many bytes from the start are in place. `closed`,
    once set, says the file is complete before the body ends (one of many a writer fills in turn): the hashing
    finishes then, and its thread and file go. On a normal exit the digest is kept for `write_manifest`; after
    an exception the hashing is dropped."""
    path = path.absolute()
    done, dropped = threading.Event(), threading.Event()
    result: list[str] = []

    def follow(f) -> None:
        digest = hashlib.sha256()
        position = 0
        with f:
            while True:
                # Read before the last pass, so that nothing written is missed.
                finished = done.is_set() or (closed is not None and closed.is_set())
                limit = os.fstat(f.fileno()).st_size if finished or written is None else written()
                while position < limit and not dropped.is_set():
                    position = _hash_window(digest, f.fileno(), position, limit)
                if finished or dropped.is_set():
                    break
                done.wait(_FOLLOW_POLL_S)
        if not dropped.is_set():
            result.append(digest.hexdigest())

    # The follower is handed the file open: were it to open the path itself, a conversion interrupted as the
    # follower starts (KeyboardInterrupt, SIGTERM) could remove the output before the open, which then fails.
    source = open(path, "rb", buffering=0)
    follower = threading.Thread(target=follow, args=(source,), name=f"sha256 {path.name}", daemon=True)
    try:
        follower.start()
        yield
    except BaseException:
        dropped.set()
        done.set()
        if follower.ident is not None:  # started: an interruption can land within start()
            follower.join()
        else:
            source.close()
        raise
    done.set()
    follower.join()
    if result:
        stat = path.stat()
        with _hashed_lock:
            _hashed_while_written[path] = (stat.st_size, stat.st_mtime_ns, result[0])


def hand_over_digests(directory: Path) -> dict[str, tuple[int, int, str]]:
    """The digests this process took while writing files under `directory`, by path relative to it, no longer
    kept here: for the process that writes the manifest (`adopt_digests`), which did not write those files."""
    directory = directory.absolute()
    with _hashed_lock:
        mine = [path for path in _hashed_while_written if path.is_relative_to(directory)]
        return {str(path.relative_to(directory)): _hashed_while_written.pop(path) for path in mine}


def adopt_digests(directory: Path, taken: dict[str, tuple[int, int, str]]) -> None:
    """Use digests another process took (`hand_over_digests`) for the files under `directory`, as if taken here:
    each still only while its file keeps the size and modification time it had."""
    directory = directory.absolute()
    with _hashed_lock:
        _hashed_while_written.update({directory / name: entry for name, entry in taken.items()})


def _hash(path: Path) -> str:
    """The digest of `path`: the one taken while it was written if the file is unchanged since, else read now."""
    path = path.absolute()
    with _hashed_lock:
        known = _hashed_while_written.pop(path, None)
    stat = path.stat()
    if known is not None and known[:2] == (stat.st_size, stat.st_mtime_ns):
        return known[2]
    return sha256_of(path)


def _files(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST
    )


def _hash_all(directory: Path, names: list[str], reuse: bool = False) -> list[str]:
    hash_one = _hash if reuse else sha256_of
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda name: hash_one(directory / name), names))


def write_manifest(directory: Path) -> None:
    """Hash every file under `directory` into its manifest."""
    names = _files(directory)
    lines = [f"{digest}  {name}\n" for name, digest in zip(names, _hash_all(directory, names, reuse=True))]
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
