#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (scripts/install.sh), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${VENV:-.venv}/bin/activate"
python -m pytest -q -p no:cacheprovider "$@"
bash scripts/mcore_versions.sh  # the CPU load check against each supported megatron-core (docs/verification.md)
