#!/usr/bin/env bash
# Which megatron-core versions load mconvert's checkpoints: scripts/checks/mcore_load_check.py (verify on CPU gloo
# ranks, logits against transformers) against each version, one Markdown table row per version and model.
#
#   scripts/checks/mcore_versions.sh [PYTHON "VERSION..."]...
#
# Each PYTHON runs its VERSIONs. A version other than the one installed in PYTHON's environment is installed alone
# (--no-deps: the environment's torch and numpy serve it, though 0.13 to 0.15 declare numpy<2) into
# .mcore/pyX.Y/VERSION and put in front of it with PYTHONPATH. Default: the Python 3.11 venv (scripts/install.sh)
# with 0.13.1 0.14.0 0.15.3 0.16.1, and the Python 3.12 venv (VENV312, default .venv312) with 0.17.0 0.18.0 0.19.2,
# which need Python >= 3.12. The models: scripts/checks/mcore_load_check.py's default, or MCORE_CHECK_MODELS="dense moe
# gated mla llama qwen2 mixtral deepseek". Exit 1 when any row is not as expected.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ]; then
    set -- "${VENV:-.venv}/bin/python" "0.13.1 0.14.0 0.15.3 0.16.1" "${VENV312:-.venv312}/bin/python" "0.17.0 0.18.0 0.19.2"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
echo "| megatron-core | Python | model | result | max abs logit diff | notes |"
echo "|---|---|---|---|---|---|"
status=0
while [ $# -gt 0 ]; do
    python=$1 versions=$2
    shift 2
    if [ ! -x "$python" ]; then
        echo "mcore_versions.sh: no Python at $python (for megatron-core $versions)" >&2
        exit 2
    fi
    tag=$("$python" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
    installed=$("$python" -c 'from importlib.metadata import version; print(version("megatron-core"))' 2>/dev/null || true)
    for version in $versions; do
        started=$(date +%s)
        shadow=
        if [ "$version" != "$installed" ]; then
            shadow=.mcore/$tag/$version
            if [ ! -d "$shadow" ]; then
                rm -rf "$shadow.partial"
                "$python" -m pip install -q --disable-pip-version-check --no-deps --target "$shadow.partial" \
                    "megatron-core==$version"
                mv "$shadow.partial" "$shadow"
            fi
        fi
        installed_at=$(date +%s)
        path=$(IFS=:; echo "${shadow:-}${shadow:+${PYTHONPATH:+:}}${PYTHONPATH:-}")
        PYTHONPATH=$path "$python" scripts/checks/mcore_load_check.py \
            --work "$work" --expect "$version" ${MCORE_CHECK_MODELS:+--models $MCORE_CHECK_MODELS} || status=1
        echo "megatron-core $version ($tag): install $((installed_at - started)) s, check $(($(date +%s) - installed_at)) s" >&2
    done
done
exit $status
