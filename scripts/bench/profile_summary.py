"""Where each thread of a profiled run spent its time: py-spy's raw samples (`py-spy record --threads --idle
-f raw -o FILE`) summed per thread and per innermost frame, the largest first.

    python scripts/bench/profile_summary.py --rate 100 h2m.raw m2h.raw
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def summarize(path: Path, rate: float, top: int) -> str:
    per_thread: collections.Counter[str] = collections.Counter()
    per_frame: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        per_thread[frames[0]] += int(count)
        per_frame[(frames[0], frames[-1])] += int(count)
    lines = [f"== {path.name}: seconds per thread"]
    lines += [f"{n / rate:8.2f}  {thread}" for thread, n in per_thread.most_common()]
    lines.append(f"== {path.name}: seconds per thread and innermost frame")
    lines += [f"{n / rate:8.2f}  {thread[:40]:40}  {frame}" for (thread, frame), n in per_frame.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--rate", type=float, default=100, help="py-spy's samples per second (-r)")
    parser.add_argument("--top", type=int, default=30)
    options = parser.parse_args()
    print("\n\n".join(summarize(path, options.rate, options.top) for path in options.profiles))


if __name__ == "__main__":
    main()
