"""Parallel execution of a conversion, in one place: threads within a process (`--workers`) and processes
across machines (ranks of torch.distributed, started by torchrun).

Both directions are a list of independent pieces, each loaded (read from the source files and transformed)
and then stored (written to the output files). `run_pieces` runs them on `workers` threads: file reads,
writes and tensor copies release the GIL, so threads overlap them as processes would, sharing the source's
metadata and the output files' layout. A piece is loaded ahead of its store only while the loaded, unwritten
pieces take at most `workers` times the budget of one (the largest piece, or READ_AHEAD_BYTES when larger):
memory stays bounded by the worker count, whatever the model's size.

`Ranks` is this process's place among the ranks of a torchrun job (gloo: works on CPU-only hosts and across
nodes). Pieces are assigned to ranks by size (`assign`; mcore-to-hf shares out whole HF files); each rank
writes its own files into the shared output directory; rank 0 merges what they wrote and finishes the
checkpoint after every rank reported success.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np

from mconvert import slices
from mconvert.errors import ConversionError

Item = TypeVar("Item")
Loaded = TypeVar("Loaded")

# How much of the pieces that follow the ones being written each worker may hold read in advance: about a
# layer of a 7B model, small next to what its largest tensors take anyway.
READ_AHEAD_BYTES = 512 << 20
# Consecutive items smaller than this go between threads together: a hand-off (a future, a wake-up) per item
# costs more than the work of a small one (a MoE expert's few MB, copied file to file by the kernel).
HAND_OFF_BYTES = 64 << 20
# Memory the default worker count leaves per worker: a read-ahead window and a large piece being written.
MEMORY_PER_WORKER = 2 << 30
# Beyond this many workers the disk, not the cores, bounds a conversion that copies bytes. One that dequantizes or
# quantizes weights spreads each large tensor over every core (mconvert.slices) instead of taking more workers,
# which would each hold a tensor more.
COPYING_WORKERS = 8


def machine_share() -> tuple[int, int]:
    """(cores, bytes of memory available) of this process: those it may run on and the kernel's MemAvailable (the
    page cache it can drop counted), under torchrun the machine's share of this rank (divided by the ranks on it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        available = MEMORY_PER_WORKER
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local_ranks), available // local_ranks


def default_workers() -> int:
    """Workers for this process: one per core it may run on, at most COPYING_WORKERS, and no more than the available
    memory holds (MEMORY_PER_WORKER each)."""
    cores, available = machine_share()
    return max(1, min(cores, COPYING_WORKERS, available // MEMORY_PER_WORKER))


def check_workers(workers: int | None) -> int:
    """`workers`, or the default."""
    if workers is None:
        return default_workers()
    if workers < 1:
        raise ConversionError(f"--workers {workers}: must be at least 1")
    return workers


class Buffers:
    """Memory to read into, handed back once its piece is written and reused by later reads: the fresh pages
    of a new buffer cost the kernel a fault and a zeroing each, more than the read itself. A buffer serves
    requests of half its size or more; free ones beyond `keep_bytes` are let go, largest first, so that
    one-off sizes (the embedding) are not kept. Thread-safe."""

    def __init__(self, keep_bytes: int = READ_AHEAD_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fitting = [i for i, buffer in enumerate(self._free) if nbytes <= buffer.size <= 2 * nbytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].size))
        return np.empty(nbytes, dtype=np.uint8)

    def give_back(self, buffers: list[np.ndarray]) -> None:
        with self._lock:
            self._free = sorted(self._free + buffers, key=lambda buffer: buffer.size)
            while sum(buffer.size for buffer in self._free) > self.keep_bytes:
                self._free.pop()


@contextlib.contextmanager
def one_core_per_tensor_op():
    """Torch's tensor ops on one core each while it lasts (threads started meanwhile included). The workers
    are the conversion's parallelism; torch's own pool spreads each copy or scan, bound by memory and at disk
    rates, over every core, and its threads spin between ops (OpenMP's wait policy): on the GPU machine's
    32-core host, hf-to-mcore at one worker took 210 CPU-seconds for 16 s, and 20 with this. Nothing to do where
    torch is not imported (numpy's copies run on the calling thread)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _slices_on_every_core():
    """A large tensor's (de)quantization on one thread per core of this process's share (mconvert.slices), whatever
    the worker count: the workers wait for their slices, so the threads at work stay about the cores."""
    with slices.threads(machine_share()[0]):
        yield


@one_core_per_tensor_op()
@_slices_on_every_core()
def run_pieces(
    items: Sequence[Item],
    sizes: Sequence[int],
    load: Callable[[Item], Loaded],
    store: Callable[[int, Item, Loaded], None],
    workers: int = 1,
    done: Callable[[Item], None] = lambda item: None,
    streams: Sequence[Hashable] | None = None,
) -> None:
    """`store(worker, item, load(item))` for every item, on `workers` writer threads (`worker` is the
    writer's number, 0 to workers - 1, e.g. to pick its own output file) fed by `workers` loading threads;
    `done(item)` after each store, one at a time (e.g. to report progress).

    Items are loaded in order, ahead of their store, while the loaded and unstored ones take at most
    `workers` x max(largest item, READ_AHEAD_BYTES) bytes (`sizes`); each writer always has one run of items
    coming. Consecutive items go from a loading thread to a writer in runs of up to HAND_OFF_BYTES (one item
    when larger), stored in order by one writer. The first failure stops the loading and is raised once the
    writers have stopped.

    `streams` (one per item, e.g. the output file it goes to) interleaves the work: runs keep to one stream,
    and up to `workers` streams are worked on at once (see `interleave_streams`), each in its items' order."""
    if not items:
        return
    runs: list[list[int]] = []
    run_sizes: list[int] = []
    for index, size in enumerate(sizes):
        joins = runs and run_sizes[-1] + size <= HAND_OFF_BYTES
        if joins and (streams is None or streams[index] == streams[runs[-1][-1]]):
            runs[-1].append(index)
            run_sizes[-1] += size
        else:
            runs.append([index])
            run_sizes.append(size)
    if streams is not None:
        order = interleave_streams([streams[run[0]] for run in runs], run_sizes, workers)
        runs, run_sizes = [runs[i] for i in order], [run_sizes[i] for i in order]
    budget = workers * max(max(sizes), READ_AHEAD_BYTES)
    lock = threading.Condition()
    pending: deque[tuple[int, Future[list[Loaded]]]] = deque()
    state = {"queued": 0, "in_flight": 0, "failed": None}
    loader = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mconvert-load")

    def load_run(run: list[int]) -> list[Loaded]:
        # A failure stops the loading at once, not when a writer comes to the failed run: no more runs are
        # queued, and those queued already are not read.
        with lock:
            if state["failed"] is not None:
                raise CancelledError
        try:
            return [load(items[index]) for index in run]
        except BaseException as error:
            with lock:
                if state["failed"] is None:
                    state["failed"] = error
            raise

    def refill() -> None:
        """Queue loads while the budget allows (under `lock`); at least one per writer waiting."""
        while state["queued"] < len(runs) and state["failed"] is None and (
            len(pending) < workers or state["in_flight"] + run_sizes[state["queued"]] <= budget
        ):
            number = state["queued"]
            pending.append((number, loader.submit(load_run, runs[number])))
            state["in_flight"] += run_sizes[number]
            state["queued"] += 1

    def write(worker: int) -> None:
        while True:
            with lock:
                refill()
                if not pending or state["failed"] is not None:
                    return
                number, future = pending.popleft()
            try:
                loaded = future.result()
                for position, index in enumerate(runs[number]):
                    store(worker, items[index], loaded[position])
                    loaded[position] = None  # its memory may go (or back to its pool) before the run ends
                del loaded
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread below
                with lock:
                    if state["failed"] is None:
                        state["failed"] = error
                return
            with lock:
                state["in_flight"] -= run_sizes[number]
                for index in runs[number]:
                    done(items[index])

    # Waited for through events, not Thread.join: a join that an interruption (Ctrl-C, SIGTERM) lands in marks
    # a running thread as stopped on Python 3.11 (bpo-45274), and a writer left running into the interpreter's
    # exit aborts it in a torch call ("terminate called without an active exception").
    stopped = [threading.Event() for _ in range(workers)]

    def writer(worker: int) -> None:
        try:
            write(worker)
        finally:
            stopped[worker].set()

    writers = [threading.Thread(target=writer, args=(w,), name=f"mconvert-write-{w}") for w in range(workers)]
    try:
        for thread in writers:
            thread.start()
        for event in stopped:
            event.wait()
    except BaseException as error:  # this thread interrupted: the writers stop after their current run
        with lock:
            if state["failed"] is None:
                state["failed"] = error
        for thread, event in zip(writers, stopped):
            if thread.ident is not None:
                event.wait()
        raise
    finally:
        loader.shutdown(cancel_futures=True)  # after a failure, read no further
    if state["failed"] is not None:
        raise state["failed"]


def interleave_streams(streams: Sequence[Hashable], sizes: Sequence[int], open_at_once: int) -> list[int]:
    """An order of the runs (their `streams` and `sizes`, in each stream's order) that works on up to
    `open_at_once` streams at a time, in their order of first appearance: next, the run of the open stream
    with the most bytes left, so that the open streams finish together. What it is for: an output file is
    hashed for the manifest while it fills, by one thread at one core's SHA-256 rate; files filled one
    after another cap the conversion at that rate, files filled side by side do not."""
    by_stream: dict[Hashable, deque[int]] = {}
    for index, stream in enumerate(streams):
        by_stream.setdefault(stream, deque()).append(index)
    left = {stream: sum(sizes[i] for i in runs) for stream, runs in by_stream.items()}
    waiting = deque(by_stream)
    open_streams: list[Hashable] = []
    order: list[int] = []
    while waiting or open_streams:
        while waiting and len(open_streams) < open_at_once:
            open_streams.append(waiting.popleft())
        stream = max(open_streams, key=lambda s: left[s])  # the first of equals: ties go in order
        index = by_stream[stream].popleft()
        order.append(index)
        left[stream] -= sizes[index]
        if not by_stream[stream]:
            open_streams.remove(stream)
    return order


def assign(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `sizes` split into `parts` lists of about equal total size (largest first, each to the
    least loaded part), each list in increasing order; the same on every rank."""
    loads = [0] * parts
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        assigned[part].append(index)
        loads[part] += sizes[index]
    return [sorted(indices) for indices in assigned]


def torchrun_rank() -> tuple[int, int]:
    """This process's rank and the number of ranks, as torchrun's environment gives them; (0, 1) outside it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Ranks:
    """This process among the ranks of a torch.distributed job; one rank of one when not started by torchrun.

    Collectives go through a gloo group (CPU tensors and pickled objects, on any host). `settle` is the one
    point where the ranks learn whether all of them succeeded: a rank that fails before it settles with its
    error from its error path, so that nobody waits for it and nothing is finished. Used as a context manager,
    it destroys on exit the groups it made: a gloo group left to the interpreter's teardown can abort the
    process (SIGABRT, "terminate called without an active exception") after the conversion succeeded."""

    def __init__(self) -> None:
        self.rank, self.world = torchrun_rank()
        self.group = None
        self.settled = False
        self._made_default_group = False
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                timeout = datetime.timedelta(seconds=float(os.environ.get("MCONVERT_DIST_TIMEOUT", "3600")))
                dist.init_process_group("gloo", timeout=timeout)
                self._made_default_group = True
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.world == 1:
            return
        import torch.distributed as dist

        if self._made_default_group:
            dist.destroy_process_group()  # and every group made in it
        elif self.group is not None:
            dist.destroy_process_group(self.group)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def settle(self, error: str | None = None) -> None:
        """Wait until every rank got here, having succeeded (`error` None) or failed; on the ranks that
        succeeded, raise the first failed rank's error, so that every rank's output names the cause."""
        self.settled = True
        if self.world == 1:
            return
        import torch.distributed as dist

        errors: list[str | None] = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
        if error is None and failed:
            rank, message = failed[0]
            raise ConversionError(f"rank {rank} failed, so nothing was finished: {message}")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def mine(self, sizes: Sequence[int]) -> list[int]:
        """Indices of the items (of `sizes` bytes each) this rank converts."""
        return assign(sizes, self.world)[self.rank] if self.world > 1 else list(range(len(sizes)))
