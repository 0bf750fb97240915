"""A training save kept by `gpu_train.py --keep-saves` made into a test fixture (tests/fixtures/fsdp, MADE.md there).

    python scripts/gpu/save_fixture.py KEPT_JOB_DIR FIXTURE_DIR

FIXTURE_DIR gets the save, the HF config, the token rows, Megatron-LM's per-micro-batch losses of every rank
(losses.jsonl) and the job, and weights.sha256.json: shape, dtype and sha256 of each tensor the run dumped at its
first step, by the model's own name (the wrappers' `module.` levels removed). A run with experts over several
expert-parallel ranks dumped each rank's experts apart (weights.pt.ep{k}, local numbers): they are numbered
globally here, as the saves number them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

import torch

# An expert's local number: TEGroupedMLP's weight suffix, or SequentialMLP's local_experts index.
GROUPED = re.compile(r"^(?P<scope>.*\.experts\.)(?P<sub>linear_fc\d\.(?:weight|bias))(?P<index>\d+)$")
SEQUENTIAL = re.compile(r"^(?P<scope>.*\.experts\.local_experts\.)(?P<index>\d+)(?P<sub>\..*)$")


def model_name(name: str) -> str:
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def numbered_globally(tensors: dict[str, torch.Tensor], expert_rank: int) -> dict[str, torch.Tensor]:
    """The rank's experts under global numbers: rank k's local expert i is k * (experts a rank holds) + i."""
    held: dict[str, set[int]] = {}
    for name in tensors:
        match = GROUPED.match(name) or SEQUENTIAL.match(name)
        if match:
            held.setdefault(match["scope"], set()).add(int(match["index"]))
    renamed = {}
    for name, tensor in tensors.items():
        match = GROUPED.match(name) or SEQUENTIAL.match(name)
        if match:
            number = expert_rank * len(held[match["scope"]]) + int(match["index"])
            name = f"{match['scope']}{match['sub']}{number}" if GROUPED.match(name) else f"{match['scope']}{number}{match['sub']}"
        renamed[name] = tensor
    return renamed


def digests(kept: Path) -> dict[str, dict]:
    merged: dict[str, torch.Tensor] = {}
    for dump in sorted(kept.glob("weights.pt*")):
        if dump.name.endswith(".error"):
            raise SystemExit(f"{dump}: the run could not dump its weights: {dump.read_text()}")
        rank = int(dump.name.removeprefix("weights.pt.ep") or 0) if dump.name != "weights.pt" else 0
        tensors = {model_name(name): tensor for name, tensor in torch.load(dump, weights_only=True).items()}
        merged.update(numbered_globally(tensors, rank) if rank else tensors)
    if not merged:
        raise SystemExit(f"{kept}: no weights.pt")
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
               "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}
        for name, t in merged.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kept", type=Path)
    parser.add_argument("fixture", type=Path)
    options = parser.parse_args()
    kept, fixture = options.kept, options.fixture
    fixture.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(fixture / "save", ignore_errors=True)
    shutil.copytree(kept / "save", fixture / "save")
    shutil.copy(kept / "hf" / "config.json", fixture / "config.json")
    shutil.copy(kept / "tokens.npy", fixture / "tokens.npy")
    shutil.copy(kept / "job.json", fixture / "job.json")
    losses = [line for log in sorted((kept / "log0").glob("rank*.jsonl")) for line in log.read_text().splitlines()]
    (fixture / "losses.jsonl").write_text("".join(line + "\n" for line in losses))
    (fixture / "weights.sha256.json").write_text(json.dumps(digests(kept), indent=1) + "\n")
    print(f"{fixture}: {sum(f.stat().st_size for f in fixture.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
