"""Finishing a conversion atomically: a directory appears complete under its final name, or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mconvert.errors import ConversionError
from mconvert.manifest import write_manifest


def check_target(save_dir: Path, overwrite: bool) -> None:
    if save_dir.exists() and not overwrite:
        raise ConversionError(f"--save-dir {save_dir} already exists (pass --overwrite to replace it)")


@contextmanager
def atomic_directory(save_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `save_dir` to fill; on success its manifest is written and it is renamed
    to `save_dir` (replacing an old one when `overwrite`), on failure removed. A crash leaves only a `.tmp-`
    directory behind."""
    save_dir = save_dir.absolute()
    check_target(save_dir, overwrite)
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.tmp-", dir=save_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint should not be
    try:
        yield work
        write_manifest(work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if save_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.old-", dir=save_dir.parent))
        os.rename(save_dir, old / save_dir.name)
        os.rename(work, save_dir)
        shutil.rmtree(old)
    else:
        os.rename(work, save_dir)
