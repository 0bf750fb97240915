#!/usr/bin/env bash
# Transformer Engine 2.20.2 and megatron-core 0.19.2 for the GPU machine (Python 3.12, torch 2.11 with CUDA 13,
# nvcc, no network). One transfer to that machine carries at most 64 MiB, so TE's 276 MB core wheel travels in
# five parts, one transfer each, into /tmp/teparts there (files in /tmp survive only while the machine is kept).
#
#   bash scripts/gpu/gpu_te_setup.sh prepare   # here, from the repository root: downloads (about 290 MB) into
#                                              # .tep1 ... .tep5 (one part each), .tebuild (TE's torch extension
#                                              # sdist, the metapackage, pydantic) and .whl (megatron-core); all
#                                              # git-ignored
#   bash scripts/gpu/gpu_te_setup.sh install   # there, once the five parts are in /tmp/teparts and .tebuild, .whl
#                                              # were carried: installs into $TE_SITE (default /tmp/site), builds TE's
#                                              # torch extension against the machine's torch (87 s with 32 jobs,
#                                              # measured on the 2-GPU host), checks the imports
# Then: export PYTHONPATH=$TE_SITE:$PYTHONPATH.
#
# What was learned: TE's torch extension is a plain C++ extension (headers only at build time, it finds
# libtransformer_engine.so at import); the `transformer-engine` metapackage must be installed too, or the import
# stops with "Could not find `transformer-engine`"; TE's recipes import pydantic, which the machine lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root, where .tep1 ... .tep5, .tebuild and .whl lie
TE=2.20.2
MCORE=0.19.2
case "${1:-}" in
prepare)
  wheels=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  rm -rf .tebuild .tep1 .tep2 .tep3 .tep4 .tep5 && mkdir -p .tebuild .whl
  python3 -m pip download -q "${wheels[@]}" -d .whl megatron-core==$MCORE
  python3 -m pip download -q "${wheels[@]}" -d .tebuild transformer-engine-cu13==$TE transformer-engine==$TE \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  python3 -m pip download -q --no-deps -d .tebuild transformer-engine-torch==$TE
  core=$(ls .tebuild/transformer_engine_cu13-$TE-*.whl)
  basename "$core" > .tebuild/core_wheel_name
  split -b 56M -d -a 1 "$core" .tebuild/tepart_ && rm "$core"
  for i in 0 1 2 3 4; do mkdir -p .tep$((i + 1)) && mv .tebuild/tepart_$i .tep$((i + 1))/; done
  du -sh .whl .tebuild .tep?
  ;;
install)
  SITE=${TE_SITE:-/tmp/site}
  mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
  [ "$(ls /tmp/teparts/tepart_* 2>/dev/null | wc -l)" = 5 ] || { echo "gpu_te_setup: need the five parts in /tmp/teparts" >&2; exit 1; }
  whl=/tmp/$(cat .tebuild/core_wheel_name)
  cat /tmp/teparts/tepart_0 /tmp/teparts/tepart_1 /tmp/teparts/tepart_2 /tmp/teparts/tepart_3 /tmp/teparts/tepart_4 > "$whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$whl" .tebuild/*.whl
  if ! PYTHONPATH=$SITE python3 -c "import transformer_engine_torch" 2>/dev/null; then
    src=$(mktemp -d) && tar xzf .tebuild/transformer_engine_torch-$TE.tar.gz -C "$src"
    (cd "$src"/transformer_engine_torch-$TE && PYTHONPATH=$SITE NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 \
       MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$src/out" .)
    cp -r "$src"/out/* "$SITE"/
  fi
  PYTHONPATH=$SITE python3 -c "import transformer_engine, transformer_engine.pytorch, megatron.core, megatron.training; print('transformer_engine', transformer_engine.__version__, 'megatron-core', megatron.core.__version__)"
  ;;
*)
  echo "usage: $0 prepare|install" >&2
  exit 2
  ;;
esac
