"""Progress of a conversion: the converters report tensors and bytes done to a `Progress`; the command line
shows them as a bar with rate and ETA on a terminal (tqdm), as a plain line every tenth of the work (or every
PLAIN_INTERVAL_S) otherwise, or not at all. Under torchrun each rank reports its own share, in lines that name
the rank: the ranks share the terminal, where their bars would overwrite one another."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

# Longest gap between two plain progress lines, for logs of slow conversions.
PLAIN_INTERVAL_S = 60.0
# Shortest: a conversion of a few seconds logs no progress at all, only its summary (or its one-line error).
PLAIN_MIN_GAP_S = 2.0


class Progress(Protocol):
    def start(self, tensors: int, nbytes: int) -> None:
        """The work ahead: `tensors` tensors of `nbytes` bytes in all."""

    def advance(self, tensors: int, nbytes: int) -> None:
        """`tensors` more tensors of `nbytes` bytes are written."""

    def close(self) -> None:
        """The work is over (done or failed)."""


class NoProgress:
    def start(self, tensors: int, nbytes: int) -> None:
        pass

    def advance(self, tensors: int, nbytes: int) -> None:
        pass

    def close(self) -> None:
        pass


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000:
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes:.0f} B"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def human_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class PlainProgress:
    """A line `label: 40% (80/199 tensors, 6.1 GB of 15.2 GB), 310.2 MB/s, ETA 0:29` at every tenth of the
    bytes (`min_gap_s` apart at least), and at least every PLAIN_INTERVAL_S."""

    def __init__(self, label: str, stream: TextIO, min_gap_s: float = PLAIN_MIN_GAP_S):
        self.label, self.stream, self.min_gap_s = label, stream, min_gap_s
        self.tensors = self.nbytes = self.done_tensors = self.done_bytes = 0
        self.started = self.last_time = time.perf_counter()
        self.last_tenth = 0

    def start(self, tensors: int, nbytes: int) -> None:
        self.tensors, self.nbytes = tensors, nbytes
        self.started = self.last_time = time.perf_counter()

    def advance(self, tensors: int, nbytes: int) -> None:
        self.done_tensors += tensors
        self.done_bytes += nbytes
        now = time.perf_counter()
        tenth = self.done_bytes * 10 // max(self.nbytes, 1)
        since = now - self.last_time
        if (tenth > self.last_tenth and since >= self.min_gap_s) or since >= PLAIN_INTERVAL_S:
            self.last_tenth, self.last_time = tenth, now
            rate = self.done_bytes / max(now - self.started, 1e-9)
            eta = (self.nbytes - self.done_bytes) / rate if rate else 0.0
            print(
                f"{self.label}: {100 * self.done_bytes // max(self.nbytes, 1)}% "
                f"({self.done_tensors}/{self.tensors} tensors, {human_bytes(self.done_bytes)} of {human_bytes(self.nbytes)}), "
                f"{human_bytes(rate)}/s, ETA {human_seconds(eta)}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar of bytes, with the tensor count, rate and ETA."""

    def __init__(self, label: str, stream: TextIO):
        self.label, self.stream = label, stream
        self.bar = None
        self.tensors = self.done_tensors = 0

    def start(self, tensors: int, nbytes: int) -> None:
        from tqdm import tqdm

        self.tensors = tensors
        self.bar = tqdm(total=nbytes, desc=self.label, unit="B", unit_scale=True, unit_divisor=1000, file=self.stream, dynamic_ncols=True)

    def advance(self, tensors: int, nbytes: int) -> None:
        self.done_tensors += tensors
        self.bar.set_postfix_str(f"{self.done_tensors}/{self.tensors} tensors", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_for(label: str, quiet: bool, stream: TextIO | None = None) -> Progress:
    """What the command line reports progress with: nothing when `quiet`, a bar on a terminal, lines otherwise.
    `stream`: standard error as it is when called (not as it was when this module was imported)."""
    stream = stream or sys.stderr
    if quiet:
        return NoProgress()
    from mconvert.converters.parallel import torchrun_rank

    rank, world = torchrun_rank()
    if world > 1:
        return PlainProgress(f"{label} rank {rank}/{world}", stream)
    return BarProgress(label, stream) if stream.isatty() else PlainProgress(label, stream)


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def summary(started: float, source: Path, save_dir: Path) -> str:
    """Time, sizes and throughput of a finished conversion."""
    seconds = time.perf_counter() - started
    written = directory_bytes(save_dir)
    return (
        f"{human_seconds(seconds)} ({seconds:.1f}s): {human_bytes(directory_bytes(source))} in, {human_bytes(written)} out "
        f"({human_bytes(written / max(seconds, 1e-9))}/s)"
    )
