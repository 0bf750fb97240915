"""Copying a run of bytes from one file into a place of another, in the kernel where it can."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from mconvert.errors import ConversionError

# copy_file_range refuses these where the kernel cannot copy between the two files (another file system, or
# one that does not implement it): the bytes then pass through memory, a piece at a time.
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
_PIECE = 16 << 20


def copy_range(source: int, begin: int, target: int, position: int, length: int, source_path: Path, what: str) -> None:
    """Copy `length` bytes at `begin` of open file `source` to `position` of open file `target`: by the kernel
    (copy_file_range, as `cp` copies) on one file system, else through memory. `what` names the bytes for the
    error if `source_path` ends before them."""
    done = 0
    while done < length:
        try:
            copied = os.copy_file_range(source, target, length - done, begin + done, position + done)
        except OSError as error:
            if error.errno not in _NO_KERNEL_COPY:
                raise
            data = os.pread(source, min(_PIECE, length - done), begin + done)
            copied = len(data) and os.pwrite(target, data, position + done)
        if not copied:
            raise ConversionError(f"{source_path}: truncated while copying {what}")
        done += copied
