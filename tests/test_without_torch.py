"""A conversion-only install has no torch (pyproject.toml's base dependencies): hf-to-mcore, mcore-to-hf and inspect
run here in an interpreter where `import torch` fails, both ways on a dense model and on an MoE model with
multi-latent attention at TP and EP above 1, bit for bit, and on saves that Megatron-LM made on GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mconvert.cli import main
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

FIXTURES = Path(__file__).parent / "fixtures"
# `python -m mconvert <argv>` with torch made unimportable: a None in sys.modules makes `import torch` (and of any of
# its submodules) raise ImportError. `first`: a statement run before the command (a fault injected).
_WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; {first}; "
    "sys.argv = ['mconvert', *sys.argv[1:]]; runpy.run_module('mconvert', run_name='__main__')"
)


def without_torch(*argv, first: str = "pass") -> subprocess.CompletedProcess:
    program = _WITHOUT_TORCH.format(first=first)
    return subprocess.run([sys.executable, "-c", program, *map(str, argv)], check=False, capture_output=True, text=True)


def assert_same_files(one: Path, other: Path) -> None:
    a, b = HFCheckpoint(one), HFCheckpoint(other)
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


@pytest.mark.parametrize(
    ("family", "dtype", "flags"), [("llama-3.1-8b", "bfloat16", ["--tp", "2"]), ("deepseek-v3", "float32", ["--tp", "2", "--ep", "2"])]
)
def test_both_directions_and_inspect_run_without_torch(tmp_path, family, dtype, flags):
    hf = make_hf_checkpoint(shrink(real_config(family), layers=3), tmp_path / "hf", dtype=dtype)
    for argv in (
        ["hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", *flags, "--quiet"],
        ["mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back", "--workers", "2", "--quiet"],
        ["inspect", tmp_path / "mcore"],
    ):
        done = without_torch(*argv)
        assert done.returncode == 0, done.stderr
    assert_same_files(tmp_path / "back", hf)


@pytest.mark.parametrize("save", ["fsdp/torch_dcp-llama", "fsdp/fsdp_dtensor-deepseek-ep2", "hybrid/deepseek-mtp-pp2"])
def test_megatron_lms_own_saves_export_without_torch_as_with_it(tmp_path, save):
    """Saves that torch itself wrote (Megatron-LM 0.19.2 on GPUs: an FSDP2 one, a Megatron-FSDP one at EP 2, a
    torch_dist HybridModel at PP 2) read the same without torch as in a process that has it loaded."""
    fixture = FIXTURES / save
    reference = fixture / "hf" if (fixture / "hf").is_dir() else fixture
    argv = ["mcore-to-hf", "--load-dir", fixture / "save", "--hf-config", reference, "--quiet"]
    assert main([*map(str, argv), "--save-dir", str(tmp_path / "with")]) == 0
    done = without_torch(*argv, "--save-dir", tmp_path / "without")
    assert done.returncode == 0, done.stderr
    assert_same_files(tmp_path / "without", tmp_path / "with")


def test_a_torch_import_on_the_way_back_fails_the_check(hf_model_factory, tmp_path):
    """Fault injection: a module that imports torch (the state-dict API's) pulled into the export's path fails the
    command here, as it would on an install without torch."""
    hf = hf_model_factory("llama-3.1-8b", layers=2)
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(tmp_path / "mcore"), "--quiet"]) == 0
    argv = ["mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back", "--quiet"]
    assert without_torch(*argv).returncode == 0
    done = without_torch(*argv, first="import mconvert.converters.state_dict")
    assert done.returncode != 0 and "torch" in done.stderr
