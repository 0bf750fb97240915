#!/usr/bin/env bash
# The whole test suite on a fresh machine: a virtualenv with the CPU build of torch, megatron-core (the judge
# of converted checkpoints) and transformers (the judge of HF ones), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --disable-pip-version-check torch==2.13.0  # the CPU wheel; a plain `torch` pulls a CUDA build
pip install -q --disable-pip-version-check -e '.[test]' 'megatron-core==0.16.1'
python -m pytest -q "$@"
