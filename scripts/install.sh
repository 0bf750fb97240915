#!/usr/bin/env bash
# A virtualenv with mconvert and its references: the CPU build of torch, megatron-core (loads and runs converted
# checkpoints) and transformers (the HF side). Idempotent; VENV picks the directory (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --disable-pip-version-check torch==2.13.0  # the CPU wheel; a plain `torch` pulls a CUDA build
pip install -q --disable-pip-version-check -e '.[test]' 'megatron-core==0.16.1'
