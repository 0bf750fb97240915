#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, then runs pytest in both environments:
#   .venv    (Python 3.11, megatron-core 0.16.1): everything but tests/megatron_lm, which skips itself there;
#   .venv312 (Python 3.12, megatron-core 0.19.2 with Megatron-LM's megatron.training): tests/megatron_lm, and
#            tests/test_adapters_in.py with Megatron-Bridge (scripts/install312.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python312=$(bash scripts/install312.sh)
# The Python 3.12 suite, then the CPU load check against each supported megatron-core (docs/verification.md), run
# beside the 3.11 suite: much of each test is a process starting, so two cores finish both in about the time of the
# longer one. The 3.11 suite stays in the foreground: its interruption tests send SIGINT, which a background job of a
# non-interactive shell ignores.
beside=$(mktemp) versions=$(mktemp)
trap 'rm -f "$beside" "$versions"' EXIT
# The readers' fuzzing (a minute on one core) goes beside them too, which finish that much sooner.
(MCONVERT_REQUIRE_MEGATRON_LM=1 "$python312" -m pytest -q -p no:cacheprovider tests/megatron_lm \
    && MCONVERT_MEGATRON_BRIDGE=build/megatron-bridge "$python312" -m pytest -q -p no:cacheprovider tests/test_adapters_in.py \
    && bash scripts/checks/mcore_versions.sh \
    && "${VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider tests/test_fuzz.py) > "$beside" 2>&1 &
suites=$!
# What mconvert writes read back by the oldest and the newest torch it claims (scripts/checks/torch_versions.sh), a
# third job: its environments are made once per machine (minutes of download, little CPU) and kept.
bash scripts/checks/torch_versions.sh > "$versions" 2>&1 &
torch_versions=$!
status=0
# The slowest tests named at the end: CI has 30 minutes.
MEGATRON_TRAINING_PYTHON="$python312" "${VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider --durations=25 --ignore tests/test_fuzz.py \
  --ignore tests/torch_versions "$@" \
  || status=$?
wait $suites || status=$?
wait $torch_versions || status=$?
echo "--- tests/megatron_lm (Python 3.12), scripts/checks/mcore_versions.sh, tests/test_fuzz.py ---"
cat "$beside"
echo "--- scripts/checks/torch_versions.sh ---"
cat "$versions"
exit $status
