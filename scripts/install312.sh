#!/usr/bin/env bash
# The second test environment: Python 3.12 with megatron-core 0.19.2, the first release that ships Megatron-LM's
# `megatron.training` (its argument parser, checkpoint loading and training loop), which needs Python >= 3.12.
# Idempotent; VENV312 picks the directory (default .venv312). Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV312=${VENV312:-.venv312}
find_python312() {
  local candidate
  for candidate in python3.12 "$(pyenv prefix 3.12 2>/dev/null)/bin/python" $HOME/.pyenv/versions/3.12*/bin/python \
      /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  echo "scripts/install312.sh: no Python 3.12 found (on PATH, under pyenv, /usr/local/bin or /usr/bin)" >&2
  return 1
}
if [ ! -x "$VENV312/bin/python" ]; then
  "$(find_python312)" -m venv "$VENV312"
fi
# torch 2.13 from PyPI is the CUDA build on 3.12 (about 5 GB); it runs on the CPU here.
"$VENV312/bin/pip" install -q --disable-pip-version-check torch==2.13.0 >&2
"$VENV312/bin/pip" install -q --disable-pip-version-check -e '.[test]' 'megatron-core==0.19.2' >&2
echo "$(cd "$VENV312" && pwd)/bin/python"
