"""Megatron-LM's legacy `torch` checkpoint format, read: one `torch.save` file per model-parallel rank.

    <iter dir>/mp_rank_<TP:02d>[_<PP:03d>][_<EP:03d>]/model_optim_rng.pt
        {"args": Namespace, "iteration": N, "model": {local name: tensor}, "optimizer": ..., "rng_state": ...}

Files are memory-mapped, their tensors numpy arrays over the map (mconvert.formats.pickles), so optimizer state
is never read. What the names inside mean:
mconvert.converters.legacy_source.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from mconvert.errors import ConversionError
from mconvert.formats.pickles import load_megatron_file

CHECKPOINT_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def is_legacy_checkpoint(directory: Path) -> bool:
    return any(directory.glob(f"mp_rank_*/{CHECKPOINT_FILE}"))


def load_rank_file(path: Path) -> dict:
    """One rank's file, memory-mapped (tensors are read only when touched), running nothing it names."""
    state = load_megatron_file(path, str(path))
    if not isinstance(state, dict):
        raise ConversionError(f"{path}: holds a {type(state).__name__}, not a rank's dict of model state")
    return state


def read_rank_files(directory: Path) -> tuple[argparse.Namespace | None, dict[tuple[int, int, int], dict[str, np.ndarray]]]:
    """The args the first rank stored, and each rank's model state by its (TP, PP, EP) rank."""
    ranks: dict[tuple[int, ...], Path] = {}
    for path in sorted(directory.glob(f"mp_rank_*/{CHECKPOINT_FILE}")):
        match = _RANK_DIR.match(path.parent.name)
        if match is None:
            raise ConversionError(f"{path.parent}: not a rank directory name Megatron-LM writes")
        ranks[tuple(int(g) for g in match.groups() if g is not None)] = path
    states = {suffix: load_rank_file(path) for suffix, path in ranks.items()}
    first = states[min(states)]
    args: argparse.Namespace | None = first.get("args")
    pp_size = getattr(args, "pipeline_model_parallel_size", 1) or 1
    ep_size = getattr(args, "expert_model_parallel_size", 1) or 1
    # Megatron-LM names a rank `mp_rank_TT_PPP` with pipeline parallelism, then `_EEE` with expert
    # parallelism: one suffix is the expert rank only when the args say EP without PP.
    expert_only = ep_size > 1 and pp_size == 1
    files: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
    for suffix, state in states.items():
        if "model" not in state:
            extra = " (virtual pipeline stages are not supported)" if "model0" in state else ""
            raise ConversionError(f"{ranks[suffix]}: holds no 'model' state{extra}")
        tp, rest = suffix[0], list(suffix[1:])
        pp = rest.pop(0) if rest and (len(rest) == 2 or not expert_only) else 0
        ep = rest.pop(0) if rest else 0
        if not isinstance(state["model"], dict):
            raise ConversionError(f"{ranks[suffix]}: its 'model' state is a {type(state['model']).__name__}, not a dict of tensors")
        files[(tp, pp, ep)] = state["model"]
    return args, files
