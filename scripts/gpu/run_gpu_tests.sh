#!/usr/bin/env bash
# The GPU evidence in one command: `pytest -m gpu tests/gpu` on a GPU machine, after installing what it lacks
# (Transformer Engine, megatron-core with Megatron-LM, flash-linear-attention, mamba_ssm: scripts/gpu/gpu_te_setup.sh).
#
#   bash scripts/gpu/run_gpu_tests.sh [PYTEST_ARGS]             # e.g. -k gpt_oss: one family's evidence
#   bash scripts/gpu/run_gpu_tests.sh --dry-run [PYTEST_ARGS]   # what it would install and run, the tests it selects
#
# On a machine where `import transformer_engine.pytorch, megatron.training` works already, nothing is installed. On the
# lent machines (no network, 64 MiB a call), the installs travel as in gpu_te_setup.sh: `prepare` here prints the calls,
#   here:   bash scripts/gpu/run_gpu_tests.sh prepare          # = gpu_te_setup.sh prepare
#   there:  bash scripts/gpu/run_gpu_tests.sh chunk N          # a call each chunk it names, carrying build/tepc/N
#   there:  bash scripts/gpu/run_gpu_tests.sh [PYTEST_ARGS]    # carrying .tebuild, .whl and the last chunk
# back to back (files in /tmp there last while the machine is kept). A later call on the same machine finds the
# install done. Without .tebuild nothing of it is installed, and the tests that need Megatron-LM skip.
# The quantized exports' tests (-k quantized_exports, one GPU) need compressed-tensors (and what it imports) and
# accelerate: carry build/qload, their wheels (scripts/gpu/install_missing_wheels.py says how to make them), and
# each is installed into $QLOAD_SITE (default /tmp/site-qload) where the machine lacks it or has an older one.
# vLLM (tests/gpu/test_vllm.py) travels as Transformer Engine does, by scripts/gpu/vllm_setup.sh: its chunks
# (build/vllmpc/N, a call each, `bash scripts/gpu/vllm_setup.sh chunk N`), then this script, which installs it into
# $VLLM_SITE (default /tmp/site-vllm, on the path of the vLLM processes only) where its chunks lie in /tmp/vllmpc or
# build/vllmpc, e.g. `bash scripts/gpu/run_gpu_tests.sh -k vllm` carrying the last chunk. The weight sync into a two-GPU
# vLLM engine with its figures (tests/gpu/test_engine_sync.py) likewise: `-k engine_sync`, on a machine of two GPUs.
#
# Results and logs in $OUT (default ./gpu-out): gpu_results.jsonl (a JSON line a checked metric, written as each test
# ends), verification.md and performance.md (docs/ with their GPU tables made from them: scripts/gpu/results_to_docs.py),
# gpu_tests.log (the installs and pytest, as they go), gpu_logs.tar.gz (the torchruns', jobs' and training runs' logs),
# vllm_serve.log, vllm_serve_quantized.log, vllm_sync.log and vllm_sync_MODEL.log (the vLLM processes', as they go).
# RUN_BUDGET_S (default 580): the whole command's seconds; no job starts in its last 100, pytest stops 20 s before it.
# PYTHON (default python3): the interpreter, the GPU machine's (Python 3.12 with torch). MCONVERT_COMMIT: the commit each
# result names where the tree has no .git (a lent machine's copy).
set -uo pipefail
cd "$(dirname "$0")/../.."

case "${1:-}" in
prepare)
  exec bash scripts/gpu/gpu_te_setup.sh prepare
  ;;
chunk)
  exec bash scripts/gpu/gpu_te_setup.sh chunk "${2:?chunk number}"
  ;;
--dry-run)
  dry=1
  shift
  ;;
*)
  dry=0
  ;;
esac

start=$(date +%s)
budget=${RUN_BUDGET_S:-580}
left() { echo $((budget - ($(date +%s) - start))); }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
log=$OUT/gpu_tests.log
work=${MCONVERT_GPU_WORK:-/tmp/mconvert-gpu-tests}
note() { echo "[run_gpu_tests +$(($(date +%s) - start))s] $*" | tee -a "$log"; }

# The machine's rule: no NVLink multicast (also in programs that set their own environment). fp32 comparisons under
# Transformer Engine need TF32 off (docs/verification.md, "Transformer Engine").
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NVIDIA_TF32_OVERRIDE=0
# Megatron-LM's rule for TP > 1 before Blackwell, read when CUDA starts: set before any process does.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TE_SITE=${TE_SITE:-/tmp/site} KERNELS_SITE=${KERNELS_SITE:-/tmp/site-kernels} VLLM_SITE=${VLLM_SITE:-/tmp/site-vllm}
# tests/gpu/test_vllm.py writes its vLLM processes' logs here too, as they go.
export MCONVERT_VLLM_LOGS=$OUT
# The quantized exports' packages (tests/gpu/test_quantized_exports.py): compressed-tensors, what it imports, and
# accelerate, carried as wheels in build/qload and installed here where the machine lacks them.
QLOAD_SITE=${QLOAD_SITE:-/tmp/site-qload}
export PYTHONPATH=$TE_SITE:$QLOAD_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
# The kernels' packages and mamba_ssm's stand-in for its CUDA extension, for the processes that run megatron-core's
# layers only (tests/gpu/gpu_evidence.py adds them there).
export MCONVERT_GPU_KERNELS_PATH=$KERNELS_SITE:$PWD/scripts/gpu/mamba_stand_in
export PYTHONWARNINGS=ignore
PYTHON=${PYTHON:-python3}
PYTEST=("$PYTHON" -m pytest -p no:cacheprovider -ra -m gpu tests/gpu "$@")

installed() { "$PYTHON" -c "import transformer_engine.pytorch, megatron.training" 2>/dev/null; }
vllm_chunks() { ls /tmp/vllmpc/part_* build/vllmpc/*/part_* 2>/dev/null | head -1; }

if [ "$dry" = 1 ]; then
  : > "$log"
  if installed; then note "installed already: nothing to install"
  elif [ -f .tebuild/core_wheel_name ]; then
    note "would install (scripts/gpu/gpu_te_setup.sh install) from .tebuild ($(ls .tebuild | wc -l) files), .whl ($(ls .whl | tr '\n' ' '))"
    note "chunks carried here: $(ls -d build/tepc/*/ 2>/dev/null | tr '\n' ' '); already there: $(ls /tmp/tepc 2>/dev/null | tr '\n' ' ')"
  else note "would find nothing to install from: run 'bash scripts/gpu/run_gpu_tests.sh prepare' where pip reaches the index"
  fi
  if ls build/qload/*.whl > /dev/null 2>&1; then note "would install into $QLOAD_SITE what the machine lacks of: $(cd build/qload && ls *.whl | tr '\n' ' ')"
  else note "no build/qload wheels: the quantized exports' tests run with what the machine has"
  fi
  if [ -f "$VLLM_SITE/vllm/__init__.py" ]; then note "vLLM installed already in $VLLM_SITE"
  elif [ -n "$(vllm_chunks)" ]; then note "would install vLLM (scripts/gpu/vllm_setup.sh install) into $VLLM_SITE from $(vllm_chunks | xargs dirname)"
  else note "no vLLM chunks (scripts/gpu/vllm_setup.sh prepare): the vLLM tests skip"
  fi
  note "environment: PYTHONPATH=$PYTHONPATH MCONVERT_GPU_KERNELS_PATH=$MCONVERT_GPU_KERNELS_PATH NVIDIA_TF32_OVERRIDE=0"
  note "would run: timeout <budget left - 20> ${PYTEST[*]}, MCONVERT_GPU_DEADLINE_S=<budget left - 100>, MCONVERT_GPU_WORK=$work"
  "${PYTEST[@]}" --collect-only -q 2>&1 | tee -a "$log"
  exit "${PIPESTATUS[0]}"
fi

{
  nvidia-smi -L
  "$PYTHON" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} >> "$log" 2>&1
if installed; then
  note "Transformer Engine and Megatron-LM import: nothing to install"
elif [ ! -f .tebuild/core_wheel_name ]; then
  note "no .tebuild carried: Transformer Engine and Megatron-LM not installed (the tests that need them skip)"
else
  note "install (scripts/gpu/gpu_te_setup.sh install)"
  MAX_JOBS=$(nproc) timeout "$(left)" bash scripts/gpu/gpu_te_setup.sh install >> "$log" 2>&1
  note "install: exit $?"
  if ! "$PYTHON" -c "import megatron.training" 2>/dev/null; then
    note "megatron.training does not import: the tests skip (gpu_tests.log has the install's output)"
  elif ! installed; then
    note "Transformer Engine does not import: the tests run the local spec, and say so in each result"
  fi
fi

if ls build/qload/*.whl > /dev/null 2>&1; then
  note "install what the machine lacks of build/qload into $QLOAD_SITE"
  "$PYTHON" scripts/gpu/install_missing_wheels.py build/qload "$QLOAD_SITE" >> "$log" 2>&1
  note "install: exit $?"
fi
if [ ! -f "$VLLM_SITE/vllm/__init__.py" ] && [ -n "$(vllm_chunks)" ]; then
  note "install vLLM (scripts/gpu/vllm_setup.sh install) into $VLLM_SITE"
  timeout 240 bash -x scripts/gpu/vllm_setup.sh install >> "$log" 2>&1
  note "vLLM install: exit $?"
fi

rm -rf "$work" && mkdir -p "$work"
note "pytest: $(( $(left) - 20 )) s, no job started after $(( $(left) - 100 )) s"
MCONVERT_GPU_RESULTS=$OUT/gpu_results.jsonl MCONVERT_GPU_WORK=$work MCONVERT_GPU_DEADLINE_S=$(( $(left) - 100 )) \
  timeout -k 10 "$(( $(left) - 20 ))" "${PYTEST[@]}" 2>&1 | tee -a "$log"
code=${PIPESTATUS[0]}
note "pytest: exit $code"
"$PYTHON" scripts/gpu/results_to_docs.py "$OUT/gpu_results.jsonl" --out "$OUT/verification.md" >> "$log" 2>&1
"$PYTHON" scripts/gpu/results_to_docs.py "$OUT/gpu_results.jsonl" --docs docs/performance.md --out "$OUT/performance.md" >> "$log" 2>&1
(cd "$work" && find . \( -name '*.log' -o -name '*.error' -o -name '*.json' -o -name '*.jsonl' -o -name '*.exit' -o -name ended \) \
  -size -4M -print0 | tar -czf "$OUT/gpu_logs.tar.gz" --null -T -) 2>> "$log"
exit $code
