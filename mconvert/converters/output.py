"""Finishing a conversion atomically: a directory appears complete under its final name, or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mconvert.converters.parallel import Ranks
from mconvert.errors import ConversionError


def check_target(save_dir: Path, overwrite: bool) -> None:
    if save_dir.exists() and not overwrite:
        raise ConversionError(f"--save-dir {save_dir} already exists (pass --overwrite to replace it)")


@contextmanager
def atomic_directory(save_dir: Path, overwrite: bool, ranks: Ranks | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `save_dir` to fill; on success it is renamed to `save_dir` (replacing an
    old one when `overwrite`), on failure removed. A crash leaves only a `.tmp-` directory behind.

    With several `ranks` (torchrun), rank 0 makes the directory and all fill it; the body calls
    `ranks.settle()` once its rank's share is written (a rank that fails before settles with its error);
    rank 0 finishes and renames the directory, and every rank returns once it is in place."""
    ranks = ranks or Ranks()
    save_dir = save_dir.absolute()
    check_target(save_dir, overwrite)
    work = None
    if ranks.is_first:
        save_dir.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.tmp-", dir=save_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should not be
    work = Path(ranks.broadcast(str(work)))
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
        raise
    if ranks.is_first:
        if save_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.old-", dir=save_dir.parent))
            os.rename(save_dir, old / save_dir.name)
            os.rename(work, save_dir)
            shutil.rmtree(old)
        else:
            os.rename(work, save_dir)
    ranks.barrier()
