"""Run a command and report its wall and CPU seconds and the peak of its resident memory split as the kernel
counts it (/proc/PID/status): anonymous (the process's own allocations), file-backed (mapped files: shared
libraries, memory-mapped data) and shared memory, each the peak of the sum over the command and its
descendants, sampled every 20 ms. ru_maxrss gives only the total's peak (and, for a child of a large process,
includes the parent's at the fork).

    python scripts/bench/memory_split.py -- python -m mconvert mcore-to-hf --load-dir MC --save-dir HF --workers 1
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def sample(pid: int) -> dict[str, int]:
    """Kilobytes of each field, summed over `pid` and its descendants."""
    total = dict.fromkeys(FIELDS, 0)
    for process in descendants(pid):
        try:
            with open(f"/proc/{process}/status") as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in total:
                        total[name] += int(value.split()[0])
        except OSError:
            continue
    return total


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    peaks = dict.fromkeys(FIELDS, 0)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for name, value in sample(process.pid).items():
                peaks[name] = max(peaks[name], value)
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    stop.set()
    watcher.join()
    code = os.waitstatus_to_exitcode(status)
    split = ", ".join(f"{name} {peaks[name] // 1024} MiB" for name in FIELDS)
    print(f"{seconds:.2f} s, {usage.ru_utime:.2f} user, {usage.ru_stime:.2f} sys, exit {code}; peaks: {split}; ru_maxrss {usage.ru_maxrss // 1024} MiB", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
