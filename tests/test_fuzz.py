"""The readers' fuzzing (scripts/fuzz/fuzz_readers.py, atheris) at CI's short budget: a fixed number of mutated
inputs per reader from the same seed each run, none ending otherwise than read or in mconvert's one-line error.
The long runs' figures are in docs/verification.md."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mconvert.errors import ConversionError

pytest.importorskip("atheris")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz" / "fuzz_readers.py"


def fuzz_readers():
    """The script as a module."""
    spec = importlib.util.spec_from_file_location("fuzz_readers", SCRIPT)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    return fuzz


def test_each_reader_keeps_the_contract_on_mutated_seeds(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--all", "--runs", "150", "--out", tmp_path], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert len(lines) == len(fuzz_readers().TARGETS) and all("exit 0" in line and "number_of_executed_units: 150" in line for line in lines), done.stdout


def test_the_check_lets_any_other_exception_through():
    """A reader failing otherwise than in a ConversionError is a crash the fuzzer reports."""
    fuzz = fuzz_readers()

    def refuses(data):
        raise ConversionError("bad input, said in one line")

    fuzz.check(refuses, b"")
    with pytest.raises(KeyError):
        fuzz.check(lambda data: {}[data], b"")
