"""Finishing a conversion atomically: a directory appears complete under its final name, or not at all.

While a conversion writes `<dir>`, it holds an exclusive `flock` on `.<dir>.lock` beside it, so that a second
conversion into the same target is refused instead of mixing files with the first. The kernel releases the
lock when its process ends, however it ends (SIGKILL included): a killed run leaves at most the lock file
and its `.<dir>.tmp-*` directory, which the next run into that target takes over and removes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mconvert.converters.manifest import adopt_digests, hand_over_digests, write_manifest
from mconvert.converters.parallel import Ranks
from mconvert.errors import ConversionError

# Write failures that mean the target's file system is full (or the process may write no more), not bad input.
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _out_of_space(error: BaseException | None) -> OSError | None:
    """The out-of-space OSError behind `error`, if any: torch.save reports a failed write as a RuntimeError
    raised while handling the OSError."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _OUT_OF_SPACE:
            return error
        error = error.__cause__ or error.__context__
    return None


def _raise_if_out_of_space(save_dir: Path, error: BaseException) -> None:
    full = _out_of_space(error)
    if full is not None:
        raise ConversionError(
            f"--save-dir {save_dir}: {full.strerror} while writing (nothing was kept; free space or raise "
            "the limit, and run again)"
        ) from None


def check_target(save_dir: Path, overwrite: bool) -> None:
    if save_dir.exists() and not overwrite:
        raise ConversionError(f"--save-dir {save_dir} already exists (pass --overwrite to replace it)")


def lock_path(save_dir: Path) -> Path:
    return save_dir.parent / f".{save_dir.name}.lock"


@contextmanager
def _writing_into(save_dir: Path) -> Iterator[None]:
    """Turn a failure to create or rename files beside `save_dir` (read-only, no permission, full) into
    a one-line error naming the flag."""
    try:
        yield
    except OSError as error:
        where = f": {error.filename}" if error.filename else ""
        raise ConversionError(f"--save-dir {save_dir}: cannot write there ({error.strerror}{where})") from None


@contextmanager
def target_lock(save_dir: Path) -> Iterator[None]:
    """Hold the lock of `save_dir` (an absolute path whose parent exists) for the body; refuse at once when
    another process holds it."""
    path = lock_path(save_dir)
    while True:
        with _writing_into(save_dir):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConversionError(
                f"--save-dir {save_dir}: another conversion is writing it ({holder}; lock file {path})"
            ) from None
        # A holder that finished between our open and flock has removed the file we opened: lock the file
        # the path names now, or two runs would each hold a lock of their own.
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        with _writing_into(save_dir):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.unlink(path)
        os.close(fd)


def _remove_leftovers(save_dir: Path) -> None:
    """Temporary directories of earlier runs into `save_dir` that were killed (the lock says none runs)."""
    name = glob.escape(save_dir.name)
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for leftover in save_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def atomic_directory(save_dir: Path, overwrite: bool, ranks: Ranks | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `save_dir` to fill; on success its manifest is written and it is renamed
    to `save_dir` (replacing an old one when `overwrite`), on failure removed. A crash leaves only a `.tmp-`
    directory behind, which the next run into `save_dir` removes.

    With several `ranks` (torchrun), rank 0 holds the lock, makes the directory and all fill it; the body calls
    `ranks.settle()` once its rank's share is written (a rank that fails before settles with its error);
    rank 0 writes the manifest of every rank's files and renames the directory, and every rank returns once it
    is in place (or raises rank 0's error)."""
    ranks = ranks or Ranks()
    save_dir = save_dir.absolute()
    with contextlib.ExitStack() as held:
        work: Path | None = None
        failure = None
        if ranks.is_first:
            try:
                check_target(save_dir, overwrite)
                with _writing_into(save_dir):
                    save_dir.parent.mkdir(parents=True, exist_ok=True)
                held.enter_context(target_lock(save_dir))
                check_target(save_dir, overwrite)  # a conversion that held the lock may have just finished it
                _remove_leftovers(save_dir)
                with _writing_into(save_dir):
                    work = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.tmp-", dir=save_dir.parent))
                    umask = os.umask(0)
                    os.umask(umask)
                    os.chmod(work, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should not be
            except ConversionError as error:
                failure = str(error)
                if ranks.world == 1:
                    raise
        shared = ranks.broadcast((str(work) if work is not None else None, failure))
        if shared[1] is not None:
            raise ConversionError(shared[1])
        work = Path(shared[0])
        try:
            yield work
            if not ranks.settled:
                ranks.settle()
        except BaseException as error:
            if not ranks.settled:
                with contextlib.suppress(Exception):  # the group may be broken too
                    ranks.settle(str(error) or type(error).__name__)
            if ranks.is_first:
                shutil.rmtree(work, ignore_errors=True)
            _raise_if_out_of_space(save_dir, error)
            raise
        finished = None
        # The digests each rank took of the files it wrote: rank 0 does not read them again.
        taken = ranks.gather(hand_over_digests(work))
        if ranks.is_first:
            try:
                for digests in taken:
                    adopt_digests(work, digests)
                write_manifest(work)  # every rank's files are in place once all have settled
                with _writing_into(save_dir):
                    if save_dir.exists():
                        old = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.old-", dir=save_dir.parent))
                        os.rename(save_dir, old / save_dir.name)
                        os.rename(work, save_dir)
                        shutil.rmtree(old)
                    else:
                        os.rename(work, save_dir)
            except BaseException as error:
                shutil.rmtree(work, ignore_errors=True)
                with contextlib.suppress(Exception):  # the other ranks wait for the outcome
                    ranks.broadcast(str(error) or type(error).__name__)
                _raise_if_out_of_space(save_dir, error)
                raise
        finished = ranks.broadcast(finished)
        if finished is not None:
            raise ConversionError(f"--save-dir {save_dir}: rank 0 could not finish it ({finished})")
