#!/usr/bin/env bash
# Transformer Engine 2.20.2, megatron-core 0.19.2 and the kernels' packages for the GPU machine (Python 3.12, torch
# 2.11 with CUDA 13, nvcc, no network). One call to that machine carries at most 64 MiB, the tracked tree (about
# 31 MiB) included, so TE's 276 MB core wheel travels in chunks, a call each, into /tmp/tepc there (files in /tmp
# survive only while the machine is kept, about 30 s after a call: the calls go back to back).
#
#   bash scripts/gpu/gpu_te_setup.sh prepare   # here, from the repository root: downloads (about 290 MB) into .tebuild
#                                              # (TE's torch extension sdist, the metapackage, pydantic), .whl
#                                              # (megatron-core, flash-linear-attention, mamba_ssm built without its CUDA
#                                              # extension) and build/te (the core wheel), all git-ignored, then cuts
#                                              # the core wheel into build/tepc/0, 1, ... (chunks of CHUNK_MB, default
#                                              # what a call carries beside the tree) and prints the calls
#   bash scripts/gpu/gpu_te_setup.sh chunk N   # there, carrying build/tepc/N: keeps it in /tmp/tepc
#   bash scripts/gpu/gpu_te_setup.sh install   # there, carrying .tebuild and .whl (and any chunks not yet sent): joins
#                                              # the chunks (checked against the wheel's sha256), installs into $TE_SITE
#                                              # (default /tmp/site), builds TE's torch extension against the machine's
#                                              # torch (87 s with 32 jobs, measured on the 2-GPU host), checks the
#                                              # imports; the kernels' packages into $KERNELS_SITE (default
#                                              # /tmp/site-kernels): flash-linear-attention's would take its Triton
#                                              # kernels in transformers on the CPU, so they are added to PYTHONPATH
#                                              # only where megatron-core runs
# Then: export PYTHONPATH=$TE_SITE:$PYTHONPATH.
#
# What was learned: TE's torch extension is a plain C++ extension (headers only at build time, it finds
# libtransformer_engine.so at import); the `transformer-engine` metapackage must be installed too, or the import
# stops with "Could not find `transformer-engine`"; TE's recipes import pydantic, which the machine lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root, where .tebuild, .whl and build/ lie
TE=2.20.2
MCORE=0.19.2
FLA=0.6.0
MAMBA=2.3.2.post1
MIB=$((1 << 20))

tree_bytes() {  # what every call carries: tracked files and untracked ones not ignored
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

case "${1:-}" in
prepare)
  wheels=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  rm -rf .tebuild build/te build/tepc && mkdir -p .tebuild .whl build/te
  python3 -m pip download -q "${wheels[@]}" -d .whl megatron-core==$MCORE
  python3 -m pip download -q --no-deps -d .whl fla-core==$FLA flash-linear-attention==$FLA
  # mamba_ssm is a source distribution on the index: built here without its CUDA extension (megatron-core's Mamba-2
  # layers run its Triton kernels; scripts/gpu/mamba_stand_in stands in for the extension's module), against the
  # torch of the Python 3.12 test environment (scripts/install312.sh), hence no build isolation.
  if ! ls .whl/mamba_ssm-$MAMBA-*.whl >/dev/null 2>&1; then
    MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "${VENV312:-.venv312}/bin/pip" wheel -q --no-deps --no-build-isolation \
      -w .whl mamba_ssm==$MAMBA
  fi
  python3 -m pip download -q "${wheels[@]}" -d .tebuild transformer-engine==$TE \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  python3 -m pip download -q "${wheels[@]}" -d build/te transformer-engine-cu13==$TE
  python3 -m pip download -q --no-deps -d .tebuild transformer-engine-torch==$TE
  core=$(ls build/te/transformer_engine_cu13-$TE-*.whl)
  basename "$core" > .tebuild/core_wheel_name
  sha256sum "$core" | cut -d' ' -f1 > .tebuild/core_wheel_sha256
  exec bash "$0" chunks
  ;;
chunks)
  # A chunk call carries the tree and one chunk; 1 MiB kept free.
  core=build/te/$(cat .tebuild/core_wheel_name)
  chunk_mb=${CHUNK_MB:-$(( (64 * MIB - $(tree_bytes)) / MIB - 1 ))}
  rm -rf build/tepc && mkdir -p build/tepc
  split -b "${chunk_mb}M" -d -a 2 "$core" build/tepc/chunk_
  for chunk in build/tepc/chunk_*; do n=$((10#${chunk##*_})); mkdir -p build/tepc/$n && mv "$chunk" build/tepc/$n/; done
  # The calls: a chunk each, the last one with the install's folders where they fit in one call beside the tree.
  tree=$(tree_bytes) extras=$(du -cb .tebuild .whl | tail -1 | cut -f1)
  last=$(($(ls build/tepc | wc -l) - 1)) last_bytes=$(du -cb build/tepc/$last | tail -1 | cut -f1)
  with_run= run_bytes=$extras
  if [ $((tree + extras + last_bytes + MIB)) -le $((64 * MIB)) ]; then with_run=$last run_bytes=$((extras + last_bytes)); fi
  echo "calls, back to back, each carrying the tree ($((tree / MIB)) MiB) too:"
  for n in $(seq 0 $last); do
    [ "$n" = "$with_run" ] || echo "  chunk $n    carry [\"build/tepc/$n\"]  ($(du -sm build/tepc/$n | cut -f1) MiB)"
  done
  echo "  the run    carry [\".tebuild\", \".whl\"${with_run:+, \"build/tepc/$with_run\"}]  ($((run_bytes / MIB)) MiB)"
  ;;
chunk)
  n=${2:?chunk number 0, 1, ...}
  mkdir -p /tmp/tepc && cp build/tepc/"$n"/chunk_* /tmp/tepc/ && ls -l /tmp/tepc
  ;;
install)
  SITE=${TE_SITE:-/tmp/site}
  KERNELS=${KERNELS_SITE:-/tmp/site-kernels}
  mkdir -p "$SITE" "$KERNELS" /tmp/tepc
  for carried in build/tepc/*/chunk_*; do [ -e "$carried" ] && cp "$carried" /tmp/tepc/; done
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/megatron_core-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$KERNELS" .whl/fla_core-*.whl \
    .whl/flash_linear_attention-*.whl .whl/mamba_ssm-*.whl
  whl=/tmp/$(cat .tebuild/core_wheel_name)
  cat /tmp/tepc/chunk_* > "$whl"
  if [ "$(sha256sum "$whl" | cut -d' ' -f1)" != "$(cat .tebuild/core_wheel_sha256)" ]; then
    echo "gpu_te_setup: the chunks in /tmp/tepc ($(ls /tmp/tepc | tr '\n' ' ')) do not make $(basename "$whl"): carry each of build/tepc/* once" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$whl" .tebuild/*.whl
  if ! PYTHONPATH=$SITE python3 -c "import transformer_engine_torch" 2>/dev/null; then
    src=$(mktemp -d) && tar xzf .tebuild/transformer_engine_torch-$TE.tar.gz -C "$src"
    (cd "$src"/transformer_engine_torch-$TE && PYTHONPATH=$SITE NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 \
       MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$src/out" .)
    cp -r "$src"/out/* "$SITE"/
  fi
  PYTHONPATH=$SITE python3 -c "import transformer_engine, transformer_engine.pytorch, megatron.core, megatron.training; print('transformer_engine', transformer_engine.__version__, 'megatron-core', megatron.core.__version__)"
  PYTHONPATH=$KERNELS:$SITE:scripts/gpu/mamba_stand_in python3 -c "import fla, mamba_ssm; print('flash-linear-attention', fla.__version__, 'mamba_ssm', mamba_ssm.__version__)"
  ;;
*)
  echo "usage: $0 prepare | chunks | chunk N | install" >&2
  exit 2
  ;;
esac
