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
# torchao: the reference MXFP4 quantizer of tests/test_mxfp4_export.py (through tests/mx_reference.py), in a folder of
# its own that only that process puts on its path: where transformers finds torchao it imports it with every model
# it loads, a second more and lines on stderr (which the one-line error tests read).
[ -d "$VENV/mx-reference/torchao" ] || pip install -q --disable-pip-version-check --no-deps --target "$VENV/mx-reference" torchao==0.18.0
