"""Running the command line as a user does (a child process), and what its failures must look like."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, python_path: tuple[Path, ...] = (), env: dict[str, str] | None = None, **popen) -> subprocess.CompletedProcess:
    """`mconvert ARGS` in a child process; `python_path` directories come before the repository (an import
    blocker, or a sitecustomize that instruments the child)."""
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*python_path, REPO))
    return subprocess.run(
        [sys.executable, "-m", "mconvert.cli", *map(str, args)],
        capture_output=True, text=True, env=environment, timeout=300, **popen,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *names, code: int = 1) -> str:
    """Exit `code`, no traceback, and exactly one line on stderr, `mconvert...: error: ...` naming `names`."""
    err = result.stderr.strip()
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert len(err.splitlines()) == 1 and err.startswith("mconvert") and ": error: " in err, err
    for name in names:
        assert str(name) in err, (name, err)
    return err


def assert_nothing_left(out: Path) -> None:
    """No `out`, and none of its temporary siblings or lock file."""
    assert not out.exists(), sorted(out.iterdir()) if out.is_dir() else out
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
