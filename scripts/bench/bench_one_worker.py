"""What holds hf-to-mcore on a many-core host where it is slower than `cp -r` (docs/history.md, "hf-to-mcore
at one worker on a 16-core host"). Three measurements, page cache warm, each a command:

  variants  hf-to-mcore of MODEL launched in several ways (as shipped; --allow-nonfinite; without hashing;
            a 0.5 or 0.1 ms switch interval of the interpreter's lock; torch on one thread; the check by reads into memory) and `cp -r`, ROUNDS rounds in the same order, after one unrecorded `cp -r` (the first
            model-sized write on a fresh virtual machine is the slowest: scripts/bench/bench_scaling.py)
  writer    the writing thread's loop: DCPWriter.copy_chunk of 3 MB chunks (one Qwen3-30B-A3B expert projection
            each) of a file of GB gigabytes, against copy_file_range of the same chunks; alone, and with the
            hashing of the data files, the checking of the chunks, or both, beside it, the hashing
            also reading into memory instead of mapping the page cache
  stages    hf-to-mcore of MODEL as shipped (or launched as VARIANTS say), in a fresh interpreter whose stages are timed from its launch: the
            imports, the header reads, the plan, the writing loop (and, summed over its calls, the building of
            pieces, the reads and checks of HF tensors, the copies and writes of chunks), the hashing's tail, the
            metadata, the manifest, the return and the exit
  rates     SHA-256 of GB gigabytes on one core (the manifest's hash of one data file), the NaN and Inf check of its
            experts on one thread (read into memory, and through a map), and memory copies by 1 to 8 threads

  python3 scripts/bench/bench_one_worker.py variants --work-dir DIR --model qwen3-30b-a3b@8 --rounds 3 --workers 1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_convert import make_source, remove, run_timed  # noqa: E402
from bench_scaling import warm  # noqa: E402

# Each variant: code run before mconvert's command line in a fresh interpreter, and extra flags.
_MAIN = "from mconvert.cli import run; run()"
VARIANTS = {
    "as shipped": ("import sys", []),
    "with --allow-nonfinite": ("import sys", ["--allow-nonfinite"]),
    # The manifest then lists zeros: nothing is hashed, neither while written nor at the end.
    "no hashing, --allow-nonfinite": (
        "import sys, contextlib, mconvert.converters.manifest as m, mconvert.converters.hf_to_mcore as h; "
        "h.hashed_while_written = lambda *a, **k: contextlib.nullcontext(); m._hash = lambda path: '0' * 64",
        ["--allow-nonfinite"],
    ),
    "switch interval 0.5 ms": ("import sys; sys.setswitchinterval(0.0005)", []),
    "switch interval 0.1 ms": ("import sys; sys.setswitchinterval(0.0001)", []),
    "torch on one thread": ("import sys, torch; torch.set_num_threads(1)", []),
    "check by reads": ("import sys; sys.path.insert(0, 'scripts/bench'); import bench_one_worker; bench_one_worker.check_by_reads()", []),
}


def check_by_reads() -> None:
    """HFCheckpoint.check reading each tensor into reused memory and checking it there, as before it checked
    through a map of the page cache."""
    from mconvert.converters.parallel import Buffers
    from mconvert.formats.hf_checkpoint import HFCheckpoint

    buffers = Buffers()

    def check(self, name: str, index: int | None = None) -> None:
        into = buffers.take(self.nbytes(name, index))
        try:
            self.read(name, index, into)
        finally:
            buffers.give_back([into])

    HFCheckpoint.check = check


def variants(options: argparse.Namespace) -> None:
    source = make_source(options.model, options.work_dir)
    out = options.work_dir / "out"
    if out.exists():
        remove(out)
    run_timed(["cp", "-r", str(source), str(out)])
    remove(out)
    for round_number in range(1, options.rounds + 1):
        for name in ["cp -r", *(options.variants or VARIANTS)]:
            warm(source)
            if name == "cp -r":
                command = ["cp", "-r", str(source), str(out)]
            else:
                prefix, flags = VARIANTS[name]
                command = [sys.executable, "-c", f"{prefix}; {_MAIN}", "hf-to-mcore", "--load-dir", str(source),
                           "--save-dir", str(out), "--workers", str(options.workers), *flags]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            run = run_timed(command)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            remove(out)
            print(f"round {round_number}, {name}: {run.seconds:.2f} s, +sync {run.synced_seconds:.2f} s, "
                  f"{after.ru_utime - before.ru_utime:.1f} user + {after.ru_stime - before.ru_stime:.1f} sys s", flush=True)


# The writer's chunks: one Qwen3-30B-A3B expert projection each (768 x 2048 bf16, 3 MB).
_CHUNK_SHAPE = (768, 2048)


def expert_file(work_dir: Path, gigabytes: float) -> Path:
    """A directory holding model.safetensors with one bf16 tensor 'w' of (experts, 768, 2048), of about
    `gigabytes`, random and finite (the check passes): what the writer copies and the check reads."""
    import numpy

    directory = work_dir / "source"
    chunk = _CHUNK_SHAPE[0] * _CHUNK_SHAPE[1] * 2
    count = int(gigabytes * 1e9) // chunk
    header = json.dumps({"w": {"dtype": "BF16", "shape": [count, *_CHUNK_SHAPE], "data_offsets": [0, count * chunk]}}).encode()
    header += b" " * (-len(header) % 8)
    path = directory / "model.safetensors"
    if not path.exists() or path.stat().st_size != 8 + len(header) + count * chunk:
        directory.mkdir(parents=True, exist_ok=True)
        values = numpy.frombuffer(os.urandom(64 * chunk), dtype=numpy.uint16) & 0xBFFF  # exponents below 128: finite
        with open(path, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for first in range(0, count, 64):
                f.write(values[: min(64, count - first) * chunk // 2].tobytes())
    warm(directory)
    return directory


def writer(options: argparse.Namespace) -> None:
    """The writing loop, alone and with the conversion's other threads beside it: the hashing of its data files
    as they fill (manifest.hashed_while_written), and the checking of each chunk's HF bytes ahead of its copy
    (HFCheckpoint.check through parallel.run_pieces, as hf-to-mcore's one worker runs them)."""
    import torch

    from mconvert.converters import manifest
    from mconvert.converters.manifest import hashed_while_written
    from mconvert.converters.parallel import one_core_per_tensor_op, run_pieces
    from mconvert.formats import dcp_writer
    from mconvert.formats.hf_checkpoint import HFCheckpoint

    hf = HFCheckpoint(expert_file(options.work_dir, options.gb))
    path, begin, (count, *shape), _ = hf.place("w")
    chunk = math.prod(shape) * 2
    out = options.work_dir / "out"

    def with_copy_file_range(hashing: bool, checking: bool) -> None:
        source_fd, target_fd = os.open(path, os.O_RDONLY), os.open(out / "copy", os.O_WRONLY | os.O_CREAT)
        for i in range(count):
            done = 0
            while done < chunk:
                done += os.copy_file_range(source_fd, target_fd, chunk - done, begin + i * chunk + done, i * (chunk + 4096) + done)
        os.close(source_fd)
        os.close(target_fd)

    def hash_by_reads(digest, fd: int, start: int, end: int) -> int:
        """manifest._hash_window reading into memory instead of mapping the page cache, whose unmapping
        interrupts every core that runs a thread of the process (a TLB shootdown), the writer's included."""
        view = memoryview(read_buffer.setdefault(threading.get_ident(), bytearray(64 << 20)))
        count = os.preadv(fd, [view[: min(end - start, len(view))]], start)
        digest.update(view[:count])
        return start + count

    read_buffer: dict[int, bytearray] = {}

    def with_dcp_writer(hashing: bool | str, checking: bool) -> float:
        def check(i: int) -> None:
            if checking:
                hf.check("w", i)

        def copy(worker: int, i: int, checked: None) -> None:
            write.copy_chunk("w", (i, 0, 0), tuple(shape), [(path, begin + i * chunk, chunk)])

        with contextlib.ExitStack() as hashes, one_core_per_tensor_op():
            if hashing == "by reads":
                hashes.enter_context(mock.patch.object(manifest, "_hash_window", hash_by_reads))
            follow = (lambda file, written, closed: hashes.enter_context(hashed_while_written(file, written, closed))) if hashing else None
            # No .metadata: its writer would import torch's DCP package beside the loop.
            write = dcp_writer.DCPWriter(out, follow=follow)
            write.declare("w", (count, *shape), torch.bfloat16)
            try:
                run_pieces(range(count), [chunk] * count, check, copy)
            finally:
                write.abort()
            return time.perf_counter()

    loops = {
        "copy_file_range per chunk": (with_copy_file_range, False, False),
        "DCPWriter.copy_chunk alone": (with_dcp_writer, False, False),
        "with hashing beside": (with_dcp_writer, True, False),
        "with checking beside": (with_dcp_writer, False, True),
        "with hashing and checking beside": (with_dcp_writer, True, True),
        "with hashing by reads and checking beside": (with_dcp_writer, "by reads", True),
    }
    for round_number in range(1, options.rounds + 1):
        for name, (loop, hashing, checking) in loops.items():
            out.mkdir()
            warm(options.work_dir)
            before = resource.getrusage(resource.RUSAGE_SELF)
            started = time.perf_counter()
            copied = loop(hashing, checking) or time.perf_counter()
            seconds = time.perf_counter() - started
            after = resource.getrusage(resource.RUSAGE_SELF)
            remove(out)
            print(f"round {round_number}, {name}: {seconds:.2f} s, copies done at {copied - started:.2f} s, "
                  f"{count * chunk / (copied - started) / 1e9:.2f} GB/s ({count} chunks), "
                  f"{after.ru_utime - before.ru_utime:.1f} user + {after.ru_stime - before.ru_stime:.1f} sys s", flush=True)


def rates(options: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from mconvert import dtypes
    from mconvert.converters.manifest import sha256_of
    from mconvert.converters.parallel import one_core_per_tensor_op
    from mconvert.formats.hf_checkpoint import HFCheckpoint

    directory = expert_file(options.work_dir, options.gb)
    started = time.perf_counter()
    sha256_of(directory / "model.safetensors")
    print(f"sha256 of {options.gb} GB on one core: {options.gb / (time.perf_counter() - started):.2f} GB/s", flush=True)
    # The check of each expert for NaN and Inf, on one thread: its parts, and through a map of the page cache.
    unchecked, checked = HFCheckpoint(directory, check_finite=False), HFCheckpoint(directory)
    count = unchecked.tensors["w"].shape[0]
    buffers = [np.empty(unchecked.nbytes("w", 0), dtype=np.uint8) for _ in range(64)]
    in_memory = [buffer.view(dtypes.bfloat16) for buffer in buffers]
    ways = {
        "read into memory": lambda i: unchecked.read("w", i, buffers[i % 64]),
        "read into memory and checked (dtypes.finite)": lambda i: checked.read("w", i, buffers[i % 64]),
        "dtypes.finite of bytes in memory": lambda i: dtypes.finite(in_memory[i % 64]),
        "checked through a map (HFCheckpoint.check)": lambda i: checked.check("w", i),
    }
    with one_core_per_tensor_op():
        for name, way in ways.items():
            warm(directory)
            started = time.perf_counter()
            for i in range(count):
                way(i)
            print(f"{name}, one thread: {options.gb / (time.perf_counter() - started):.2f} GB/s", flush=True)
    torch.set_num_threads(1)
    for threads in (1, 2, 4, 8):
        pairs = [(torch.ones(1 << 29, dtype=torch.uint8), torch.empty(1 << 29, dtype=torch.uint8)) for _ in range(threads)]

        def copy(a: torch.Tensor, b: torch.Tensor) -> None:
            for _ in range(4):
                b.copy_(a)

        workers = [threading.Thread(target=copy, args=pair) for pair in pairs]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        print(f"memory copies by {threads} threads: {threads * 4 * (1 << 29) / (time.perf_counter() - started) / 1e9:.1f} GB/s", flush=True)


# Functions hf-to-mcore calls once (or a few times), timed as (first start, last end); and those it calls per
# piece or chunk, timed as (calls, seconds summed over the threads that call them, first start, last end).
_ONCE = {
    "read config.json": ("mconvert.converters.hf_to_mcore", "read_hf_config"),
    "read HF headers": ("mconvert.converters.hf_to_mcore", "HFCheckpoint"),
    "build the plan": ("mconvert.converters.hf_to_mcore", "build_plan"),
    "check the sources": ("mconvert.converters.hf_to_mcore", "check_sources"),
    "write the pieces": ("mconvert.converters.hf_to_mcore", "write_pieces"),
    "writer.abort (flush, close)": ("mconvert.formats.dcp_writer", "DCPWriter.abort"),
    "writer.finish (.metadata)": ("mconvert.formats.dcp_writer", "DCPWriter.finish"),
    "write common.pt": ("mconvert.converters.hf_to_mcore", "write_common"),
    "write the manifest": ("mconvert.converters.output", "write_manifest"),
    "convert_hf_to_mcore": ("mconvert.converters.hf_to_mcore", "convert_hf_to_mcore"),
}
_PER_PIECE = {
    "build_piece (loading threads)": ("mconvert.converters.hf_to_mcore", "build_piece"),
    "HFCheckpoint.read": ("mconvert.formats.hf_checkpoint", "HFCheckpoint.read"),
    "DCPWriter.copy_chunk": ("mconvert.formats.dcp_writer", "DCPWriter.copy_chunk"),
    "DCPWriter.write_chunk": ("mconvert.formats.dcp_writer", "DCPWriter.write_chunk"),
}


def stage_child(events: Path, variant: str, argv: list[str]) -> int:
    """mconvert's command line as `mconvert.cli.run` runs it, after the code of `variant`, its stages timed
    (module docstring); the times, on the monotonic clock that the parent shares, written to `events` as JSON."""
    import functools
    import gc
    import importlib

    times: dict[str, list[float]] = {"interpreter up": [time.perf_counter()] * 2}
    exec(VARIANTS[variant][0])
    times[f"variant's code ({variant})"] = [times["interpreter up"][0], time.perf_counter()]
    import mconvert.cli

    options = mconvert.cli.build_parser().parse_args(argv)
    times["import mconvert.cli, parse"] = [times[f"variant's code ({variant})"][1], time.perf_counter()]
    mconvert.cli._import_torch_frozen()
    times["import torch, frozen"] = [times["import mconvert.cli, parse"][1], time.perf_counter()]
    import mconvert.converters.hf_to_mcore  # noqa: F401  (imported by the command; here to be patched)

    times["import the converter"] = [times["import torch, frozen"][1], time.perf_counter()]
    lock = threading.Lock()
    ends: dict[str, list[float]] = {}  # of each call of the functions timed per piece or chunk

    def wrap(label: str, module: str, name: str, summed: bool) -> None:
        owner = importlib.import_module(module)
        *path, attribute = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                with lock:
                    entry = times.setdefault(label, [0, 0.0, started, ended] if summed else [started, ended])
                    if summed:
                        entry[0] += 1
                        entry[1] += ended - started
                        ends.setdefault(label, []).append(ended)
                    entry[-1] = ended

        setattr(owner, attribute, timed)

    for label, (module, name) in _ONCE.items():
        wrap(label, module, name, False)
    for label, (module, name) in _PER_PIECE.items():
        wrap(label, module, name, True)
    status = mconvert.cli._execute(options)  # as mconvert.cli.run
    gc.freeze()
    times["command returned"] = [time.perf_counter()] * 2
    events.write_text(json.dumps({"times": times, "ends": ends}))
    return status


def stages(options: argparse.Namespace) -> None:
    source = make_source(options.model, options.work_dir)
    out, events = options.work_dir / "out", options.work_dir / "events.json"
    if out.exists():
        remove(out)
    run_timed(["cp", "-r", str(source), str(out)])
    remove(out)
    for round_number, name in itertools.product(range(1, options.rounds + 1), options.variants or ["as shipped"]):
        warm(source)
        copied = run_timed(["cp", "-r", str(source), str(out)])
        remove(out)
        warm(source)
        launched = time.perf_counter()
        run = run_timed([sys.executable, __file__, "stage-child", str(events), name, "hf-to-mcore", "--load-dir", str(source),
                         "--save-dir", str(out), "--workers", str(options.workers), *VARIANTS[name][1]])
        recorded = json.loads(events.read_text())
        times = recorded["times"]
        remove(out)
        print(f"round {round_number}: cp -r {copied.seconds:.2f} s, +sync {copied.synced_seconds:.2f} s; hf-to-mcore {name}, "
              f"{run.seconds:.2f} s to exit, +sync {run.synced_seconds:.2f} s; its stages, s from launch:", flush=True)
        for label, entry in sorted(times.items(), key=lambda item: item[1][-2]):
            start, end = entry[-2] - launched, entry[-1] - launched
            summed = f", {entry[0]} calls summing {entry[1]:.2f} s" if len(entry) == 4 else ""
            print(f"  {label}: {start:.2f} to {end:.2f} ({end - start:.2f}){summed}", flush=True)
            if label in recorded["ends"]:
                per_second = [0] * (math.ceil(end) + 1)
                for ended in recorded["ends"][label]:
                    per_second[int(ended - launched)] += 1
                print(f"    calls ended in each second from launch: {' '.join(map(str, per_second))}", flush=True)
        print(f"  exited: {run.seconds:.2f}", flush=True)


def main() -> int:
    if sys.argv[1:2] == ["stage-child"]:
        return stage_child(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measurement", choices=("variants", "writer", "stages", "rates"))
    parser.add_argument("--work-dir", type=Path, required=True, help="source and outputs (one disk); removed after")
    parser.add_argument("--model", default="qwen3-30b-a3b@8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: all (variants), as shipped (stages)")
    parser.add_argument("--gb", type=float, default=10.8, help="writer and rates: gigabytes of the file")
    options = parser.parse_args()
    options.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        {"variants": variants, "writer": writer, "stages": stages, "rates": rates}[options.measurement](options)
    finally:
        remove(options.work_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
