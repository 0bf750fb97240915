"""A training save kept by `gpu_train.py --keep-saves` made into a test fixture (tests/fixtures/fsdp, MADE.md there).

    python scripts/gpu/save_fixture.py KEPT_JOB_DIR FIXTURE_DIR [--weights-of ONE_GPU_FIXTURE]

FIXTURE_DIR gets the save, the HF config, the token rows, Megatron-LM's per-micro-batch losses of every rank
(losses.jsonl), the job, and weights.sha256.json: shape, dtype and sha256 of each tensor the run dumped at its first
step (weights.pt), by the model's own name (the wrappers' `module.` levels removed). A run on several GPUs dumps
no whole weights (gpu_train.py says why): --weights-of takes the digests of the one-GPU run of the same job, whose
init is the same but for the experts at EP above 1, which each expert-parallel rank draws for itself and dumps as
it holds them (experts/rank<R>.pt): their digests, under their global expert indices, go to experts.sha256.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

import torch


def digests(dump: Path) -> dict[str, dict]:
    if dump.with_name(dump.name + ".error").exists():
        raise SystemExit(f"{dump}: the run could not dump its weights: {dump.with_name(dump.name + '.error').read_text()}")
    return tensor_digests(torch.load(dump, weights_only=True))


def expert_digests(folder: Path) -> dict[str, dict]:
    """The experts every expert-parallel rank dumped (gpu_train.py at EP above 1), each held by one rank."""
    if errors := sorted(folder.glob("*.error")):
        raise SystemExit(f"{errors[0]}: a rank could not dump its experts: {errors[0].read_text()}")
    merged: dict[str, dict] = {}
    for dump in sorted(folder.glob("rank*.pt")):
        mine = tensor_digests(torch.load(dump, weights_only=True))
        if twice := merged.keys() & mine.keys():
            raise SystemExit(f"{dump}: experts dumped by two ranks: {sorted(twice)[:3]}")
        merged.update(mine)
    if not merged:
        raise SystemExit(f"{folder}: no experts dumped")
    return merged


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {
        re.sub(r"^(module\.)+", "", name): {
            "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
        }
        for name, t in tensors.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kept", type=Path)
    parser.add_argument("fixture", type=Path)
    parser.add_argument("--weights-of", type=Path, help="a fixture of the same job run on one GPU")
    options = parser.parse_args()
    kept, fixture = options.kept, options.fixture
    weights = json.loads((options.weights_of / "weights.sha256.json").read_text()) if options.weights_of else digests(kept / "weights.pt")
    fixture.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(fixture / "save", ignore_errors=True)
    shutil.copytree(kept / "save", fixture / "save")
    shutil.copy(kept / "hf" / "config.json", fixture / "config.json")
    shutil.copy(kept / "tokens.npy", fixture / "tokens.npy")
    shutil.copy(kept / "job.json", fixture / "job.json")
    losses = [line for log in sorted((kept / "log0").glob("rank*.jsonl")) for line in log.read_text().splitlines()]
    (fixture / "losses.jsonl").write_text("".join(line + "\n" for line in losses))
    (fixture / "weights.sha256.json").write_text(json.dumps(weights, indent=1) + "\n")
    if (kept / "experts").is_dir():
        (fixture / "experts.sha256.json").write_text(json.dumps(expert_digests(kept / "experts"), indent=1, sort_keys=True) + "\n")
    print(f"{fixture}: {sum(f.stat().st_size for f in fixture.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
