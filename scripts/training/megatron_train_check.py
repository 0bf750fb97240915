"""Check what scripts/training/megatron_train.py did, against transformers and the HF checkpoint it started from.

    python scripts/training/megatron_train_check.py tokens --hf HF --rows 8 --seq-length 256 --out tokens.npy
    python scripts/training/megatron_train_check.py check --hf HF --tokens tokens.npy --lr0-log L0 --lr0-save S0 \
        --trained-log L1 --out result.json

`tokens` writes seeded pseudo-random token ids below the HF vocabulary, shape [rows, seq_length + 1]; with
rows = --global-batch-size every training step sees the same batch (the whole file), so its loss is comparable
with transformers' on the file and falls step after step when the model learns.

`check` writes one JSON result (and prints it):
- loss: Megatron-LM's loss at every step of the --lr 0 run against transformers' fp32 loss on the same tokens
  (the weights do not move at lr 0, so every step must match), with the logits of Megatron's vocabulary padding
  (zero rows, so zero logits, inside Megatron's softmax) added to transformers'; the loss without them is
  reported beside it. Tolerance 1e-4 absolute, in fp32 only: a token's
  cross entropy logsumexp(z) - z_label moves by at most 2 max|dz| when the logits move by dz, and fp32 logits of
  the converted models agree with transformers' within about 1.3e-5 (docs/verification.md), so 1e-4 leaves a
  margin of about 4 for summation order. Needs TF32 off on GPUs (NVIDIA_TF32_OVERRIDE=0): TF32 GEMMs alone move
  logits by 1e-3 of their scale. A bf16 run is reported, not checked.
- export: `mconvert mcore-to-hf` of the --lr 0 run's training save (optimizer state, nested args, iter dir)
  against the HF input: same tensor names, and every tensor equal bit for bit (compared in the exported dtype;
  widening bf16 to fp32 is exact, so a weight that moved by any amount fails).
- learning: the losses of the run with a real learning rate fall at every step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
FP32_LOSS_TOLERANCE = 1e-4


def write_tokens(hf_dir: Path, rows: int, seq_length: int, out: Path, seed: int = 20261122) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    vocab_size = (config.get("text_config") or config)["vocab_size"]  # an image-text model's: its language model's
    generator = np.random.default_rng(seed)
    np.save(out, generator.integers(0, vocab_size, size=(rows, seq_length + 1), dtype=np.int64))


def hf_loss(
    hf_dir: Path, tokens: np.ndarray, dtype: torch.dtype, device: str, padded_vocab_size: int | None = None
) -> float:
    """transformers' mean token cross entropy over every row of the token file (token-weighted).

    With `padded_vocab_size`, the logits get the zero logits that Megatron's padding rows of the output layer
    (zero weights) give: they are part of the softmax Megatron-LM's loss takes, log(1 + pad / sum(exp(z)))
    more loss per token than transformers' over the real vocabulary (0.02 at 24 pads over 1000 tokens)."""
    from mconvert.verify.hf_side import load_hf_model  # a checkpoint shipping its own code: its class, its code not run

    model = load_hf_model(hf_dir, dtype).to(device).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in torch.from_numpy(tokens):
            row = row.to(device)
            logits = model(input_ids=row[None, :-1]).logits[0].float()
            if padded_vocab_size:
                logits = torch.nn.functional.pad(logits, (0, padded_vocab_size - logits.shape[-1]))
            total += torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").double().item()
            count += len(row) - 1
    del model
    return total / count


def megatron_losses(log_dir: Path) -> tuple[dict[int, float], dict]:
    """Per-iteration loss from every rank's micro-batch lines (summed token loss / token count)."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    info: dict = {}
    files = sorted(log_dir.glob("rank*.jsonl"))
    if not files:
        raise SystemExit(f"{log_dir}: no rank*.jsonl (did the training run start?)")
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            sums[record["iteration"]] = sums.get(record["iteration"], 0.0) + record["loss_sum"]
            counts[record["iteration"]] = counts.get(record["iteration"], 0) + record["tokens"]
            info = {key: record[key] for key in ("dtype", "transformer_impl", "padded_vocab_size")}
    return {iteration: sums[iteration] / counts[iteration] for iteration in sorted(sums)}, info


def compare_export(hf_dir: Path, save_dir: Path) -> dict:
    from safetensors import safe_open

    def tensors(directory: Path) -> dict[str, tuple[Path, str]]:
        found = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                found.update({name: (path, name) for name in f.keys()})
        return found

    def load(where: tuple[Path, str]) -> torch.Tensor:
        with safe_open(where[0], "pt") as f:
            return f.get_tensor(where[1])

    with tempfile.TemporaryDirectory() as scratch:
        exported_dir = Path(scratch) / "hf"
        done = subprocess.run(
            [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(save_dir), "--save-dir",
             str(exported_dir), "--hf-config", str(hf_dir)],
            capture_output=True, text=True, cwd=REPO,
        )
        if done.returncode:
            return {"passed": False, "error": (done.stdout + done.stderr)[-2000:]}
        original, exported = tensors(hf_dir), tensors(exported_dir)
        differing, dtypes = [], set()
        for name in sorted(original.keys() & exported.keys()):
            a, b = load(original[name]), load(exported[name])
            dtypes.add(f"{a.dtype}->{b.dtype}".replace("torch.", ""))
            if a.shape != b.shape or not torch.equal(a.to(b.dtype), b):
                differing.append(name)
        missing, extra = sorted(original.keys() - exported.keys()), sorted(exported.keys() - original.keys())
        return {
            "passed": not (differing or missing or extra),
            "tensors": len(original),
            "dtypes": sorted(dtypes),
            "differing": differing[:20],
            "missing": missing[:20],
            "extra": extra[:20],
        }


def check(options: argparse.Namespace) -> dict:
    tokens = np.load(options.tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"hf": str(options.hf), "rows": int(tokens.shape[0]), "seq_length": int(tokens.shape[1] - 1)}
    if options.lr0_log:
        losses, info = megatron_losses(options.lr0_log)
        reference = hf_loss(options.hf, tokens, torch.float32, device, info["padded_vocab_size"])
        worst = max(abs(loss - reference) for loss in losses.values())
        result["loss"] = {
            "hf_fp32_with_padding_logits": reference,
            "hf_fp32": hf_loss(options.hf, tokens, torch.float32, device),
            "megatron": losses,
            **info,
            "max_abs_diff": worst,
            "tolerance": FP32_LOSS_TOLERANCE if info["dtype"] == "float32" else None,
            "passed": worst <= FP32_LOSS_TOLERANCE if info["dtype"] == "float32" else None,
        }
    if options.lr0_save:
        result["export"] = compare_export(options.hf, options.lr0_save)
    if options.trained_log:
        losses, info = megatron_losses(options.trained_log)
        values = list(losses.values())
        result["learning"] = {
            "megatron": losses,
            **info,
            "passed": len(values) > 1 and all(b < a for a, b in zip(values, values[1:])),
        }
    passes = [part["passed"] for part in result.values() if isinstance(part, dict) and "passed" in part]
    result["passed"] = bool(passes) and all(v is not False for v in passes)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("tokens")
    make.add_argument("--hf", type=Path, required=True)
    make.add_argument("--rows", type=int, required=True)
    make.add_argument("--seq-length", type=int, required=True)
    make.add_argument("--out", type=Path, required=True)
    check_command = commands.add_parser("check")
    check_command.add_argument("--hf", type=Path, required=True)
    check_command.add_argument("--tokens", type=Path, required=True)
    check_command.add_argument("--lr0-log", type=Path, help="loss log of the --lr 0 run")
    check_command.add_argument("--lr0-save", type=Path, help="--save folder of the --lr 0 run")
    check_command.add_argument("--trained-log", type=Path, help="loss log of the run with a real learning rate")
    check_command.add_argument("--out", type=Path, required=True)
    options = parser.parse_args()
    if options.command == "tokens":
        write_tokens(options.hf, options.rows, options.seq_length, options.out)
        return 0
    result = check(options)
    options.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
