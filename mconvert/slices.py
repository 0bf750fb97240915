"""A large tensor's (de)quantization split into slices of rows, run on a pool of threads that the process shares:
numpy's ufuncs, casts and takes release the GIL, so the slices of one tensor run on as many cores as the pool has
threads, where a tensor at a time ran on one (a 3 GiB cut of Kimi-K2 is a few hundred large tensors; its dense
layer's 7168 x 18432 weights took one core for most of a second each). Each slice writes its result into its rows
of the output: the memory a thread adds is one slice's temporaries, not a tensor's.

A slice is about SLICE_ELEMENTS values, each step of it one numpy call over the whole slice: the Python between
the calls holds the GIL, and calls over slices of a few hundred thousand values left it held often enough that
threads beyond about eight waited for it. The results do not depend on the slicing: each value's arithmetic is its
own, and a slice holds whole blocks (FP8) and whole rows (INT4, MXFP4 groups).

The conversion sets the pool's size (`threads`, one per core); without it (the library's default) every slice runs
on the calling thread, one after another."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterator, Sequence, TypeVar

Item = TypeVar("Item")

# Values a slice holds, about: a thread's temporaries are a few times its bytes (SLICE_TEMPORARY_BYTES at most).
SLICE_ELEMENTS = 1 << 20
# What one thread holds at most beside the tensors in hand while it works on a slice, as measured on the largest
# slices the kernels make (FP8's 128 block rows of 18432 columns, 2.4 M values): the memory model's term per thread.
SLICE_TEMPORARY_BYTES = 32 << 20

_lock = threading.Lock()
_state: dict = {"pool": None, "users": 0}
_inside = threading.local()


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """Slices run on `count` threads while it lasts (1: on the calling thread). Conversions that overlap in one
    process share the pool the first one started, which stops when the last one ends."""
    with _lock:
        if not _state["users"] and count > 1:
            _state["pool"] = ThreadPoolExecutor(max_workers=count, thread_name_prefix="mconvert-slice", initializer=_mark)
        _state["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["users"] -= 1
            pool = _state["pool"] if not _state["users"] else None
            if pool is not None:
                _state["pool"] = None
        if pool is not None:
            pool.shutdown()


def _mark() -> None:
    _inside.pool = True


def row_slices(rows: int, row_elements: int, align: int = 1) -> list[slice]:
    """`range(rows)` in slices of about SLICE_ELEMENTS values (`row_elements` a row), each a multiple of `align`
    rows (a block's) but the last."""
    step = max(align, SLICE_ELEMENTS // max(1, row_elements) // align * align)
    return [slice(first, min(first + step, rows)) for first in range(0, rows, step)]


def run(work: Callable[[Item], None], items: Sequence[Item]) -> None:
    """`work(item)` for every item, on the pool where one is set and there are several (and not from a slice
    itself), else here in order. Returns once every item is done; the first failure is raised after."""
    pool = _state["pool"]
    if pool is None or len(items) < 2 or getattr(_inside, "pool", False):
        for item in items:
            work(item)
        return
    futures = [pool.submit(work, item) for item in items]
    wait(futures)
    for future in futures:
        future.result()
