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
# megatron-core's Mamba layers (Nemotron-H) refuse to build without mamba_ssm and einops. The index has mamba_ssm as a
# source distribution only: built here without its CUDA extension (its kernels are Triton; CPU ranks run PyTorch
# references in their place, mconvert/verify/mamba.py), against the torch above, hence no build isolation.
if ! "$VENV312/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("mamba_ssm") is None or u.find_spec("einops") is None)'; then
  "$VENV312/bin/pip" install -q --disable-pip-version-check setuptools wheel packaging >&2
  # --no-deps: what megatron-core imports of it needs torch, triton and einops alone; its other requirements (tilelang,
  # quack-kernels, nvidia-cutlass-dsl: hundreds of MB) serve Mamba-3 kernels, whose import it guards.
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$VENV312/bin/pip" install -q --disable-pip-version-check \
    --no-build-isolation --no-deps 'mamba_ssm==2.3.2.post1' >&2
  "$VENV312/bin/pip" install -q --disable-pip-version-check einops >&2
fi
# Megatron-Bridge 0.6.2, whose own LoRA loads what adapter-to-mcore writes (tests/test_adapters_in.py): its package
# alone, entered without its __init__ as scripts/fixtures/megatron_bridge_lora.py says, in a folder of its own.
if [ ! -d build/megatron-bridge/megatron/bridge ]; then
  "$VENV312/bin/pip" install -q --disable-pip-version-check --no-deps --target build/megatron-bridge 'megatron-bridge==0.6.2' >&2
fi
echo "$(cd "$VENV312" && pwd)/bin/python"
