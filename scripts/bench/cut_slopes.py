"""What each extra byte costs, apart from the fixed costs (the start, the last file's hash): for every step of
`bench_scaling.py` measured on two sizes of one model in the same run (two cuts of one config, or a cut and the
whole model), the difference in seconds over the difference in bytes, against `cp -r`'s and the parallel
copy's. A whole 1 TB conversion takes about its size times the per-byte cost: the fixed seconds are the same
for a 4 GB cut and for the whole model.

    python scripts/bench/cut_slopes.py RESULTS.jsonl [RESULTS.jsonl ...]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

GiB = 1 << 30


def config_of(model: str) -> str:
    return model.split("@")[0]


def slopes(rows: list[dict]) -> list[str]:
    """Markdown rows: per (config, step, workers, ranks), the smallest cut against the largest."""
    by_step: dict[tuple, dict[str, dict]] = collections.defaultdict(dict)
    for row in rows:
        by_step[(config_of(row["model"]), row["step"], row["workers"], row["ranks"])][row["model"]] = row
    nbytes = {row["model"]: row["gib_per_s"] * row["seconds"] * GiB for row in rows}
    copies = {key: models for key, models in by_step.items() if key[1] == "cp -r" or key[1].startswith("parallel copy")}
    lines = []
    for (config, step, workers, ranks), models in by_step.items():
        if len(models) < 2:
            continue
        small, large = sorted(models, key=nbytes.get)[0], sorted(models, key=nbytes.get)[-1]
        extra = nbytes[large] - nbytes[small]
        seconds = models[large]["seconds"] - models[small]["seconds"]
        cells = [config, f"{small} -> {large}", step, str(workers), str(ranks), f"{extra / GiB:.2f}", f"{seconds:.2f}", f"{extra / GiB / seconds:.2f}"]
        for copy_step in ("cp -r", f"parallel copy ({workers * ranks} processes)"):
            copy = copies.get((config, copy_step, workers * ranks if copy_step != "cp -r" else 1, 1), {})
            if small in copy and large in copy and step != copy_step:
                cells.append(f"{seconds / (copy[large]['seconds'] - copy[small]['seconds']):.2f}")
            else:
                cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    rows = [json.loads(line) for path in parser.parse_args().results for line in path.read_text().splitlines() if line]
    print("| config | cuts | step | workers | ranks | extra GiB | extra s | GiB/s per extra byte | vs cp -r | vs parallel copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(slopes(rows)))


if __name__ == "__main__":
    main()
