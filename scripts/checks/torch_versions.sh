#!/usr/bin/env bash
# What mconvert writes, read back by each torch the project claims (the oldest and the newest the package index
# offers within pyproject.toml's floor): tests/torch_versions/ in a virtualenv of that torch with only what the
# conversion and its readers need (numpy, safetensors, ml_dtypes, megatron-core installed alone), docs/verification.md.
#
#   scripts/checks/torch_versions.sh [PYTHON TORCH MEGATRON_CORE]...
#
# Default: Python 3.11 with torch 2.3.1 and megatron-core 0.13.1, Python 3.12 with torch 2.14.1 and megatron-core
# 0.19.2 (the interpreters of VENV and VENV312, default .venv and .venv312). Each environment is made once, in MCONVERT_TORCH_ENVS (default ~/.cache/mconvert/torch-envs: the CUDA build
# PyPI has for Linux, about 3 GB each, which runs on the CPU here), and kept for the next run. Exit 1 when a check fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ]; then  # the interpreters of the two test environments (scripts/install.sh, scripts/install312.sh)
    base() { "$1" -c 'import sys; print(sys._base_executable)'; }
    set -- "$(base "${VENV:-.venv}/bin/python")" 2.3.1 0.13.1 "$(base "${VENV312:-.venv312}/bin/python")" 2.14.1 0.19.2
fi
envs=${MCONVERT_TORCH_ENVS:-$HOME/.cache/mconvert/torch-envs}
export PYTHONWARNINGS=ignore
status=0
while [ $# -gt 0 ]; do
    python=$1 torch=$2 mcore=$3
    shift 3
    tag=$("$python" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
    venv=$envs/$tag-torch$torch-mcore$mcore
    started=$(date +%s)
    if [ ! -e "$venv/complete" ]; then
        rm -rf "$venv"
        "$python" -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch" numpy safetensors ml_dtypes huggingface-hub \
            tqdm packaging pytest
        # Alone, as scripts/checks/mcore_versions.sh installs it: the torch above serves it.
        "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "megatron-core==$mcore"
        touch "$venv/complete"
    fi
    installed=$(date +%s)
    echo "--- torch $torch, megatron-core $mcore ($tag) ---"
    PYTHONPATH=$PWD "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/torch_versions || status=1
    echo "torch $torch ($tag): install $((installed - started)) s, check $(($(date +%s) - installed)) s" >&2
done
exit $status
