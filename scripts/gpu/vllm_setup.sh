#!/usr/bin/env bash
# vLLM 0.25.0 (the release whose wheel pins the GPU machines' torch 2.11.0) and what `from vllm import LLM` and an
# offline `LLM(...).generate` need, for the GPU machine (Python 3.12, torch 2.11 with CUDA 13, no network). One call
# to that machine carries at most 64 MiB, the tracked tree (about 32 MiB) included, so the bundle travels in chunks,
# a call each, into /tmp/vllmpc there (files in /tmp survive only while the machine is kept: the calls go back to back).
#
#   bash scripts/gpu/vllm_setup.sh prepare   # here, from the repository root: downloads vLLM's wheel and the packages
#                                            # below into build/vllm (git-ignored), trims the wheel (below), packs them
#                                            # in one tar, cuts it into build/vllmpc/0, 1, ... (chunks of CHUNK_MB,
#                                            # default what a call carries beside the tree) and prints the calls
#   bash scripts/gpu/vllm_setup.sh chunk N   # there, carrying build/vllmpc/N: keeps it in /tmp/vllmpc
#   bash scripts/gpu/vllm_setup.sh install   # there (carrying any chunks not yet sent): joins the chunks (checked
#                                            # against the tar's sha256), installs into $VLLM_SITE (default
#                                            # /tmp/site-vllm) the packages the machine lacks, checks the imports
# Then, for the processes that run vLLM only: export PYTHONPATH=$VLLM_SITE:$PYTHONPATH (its pins, e.g. pydantic, stay
# out of the Megatron runs).
#
# What it took (traced on CPU, 2026-11-27: a Python 3.12 venv with torch 2.11.0, the machine's 26 packages that vLLM
# declares, vLLM installed without its requirements, then each missing module added until vllm.entrypoints.llm, the
# engine, the GPU worker and model runner, the llama/qwen2/qwen3/qwen3_moe/deepseek_v2/gpt_oss models, the FP8 and
# compressed-tensors quantization and the attention backends import): the packages of PACKAGES below, 47 of vLLM's
# declared requirements being absent there. None of the kernel packages (flashinfer, tilelang, cutlass-dsl, quack,
# deep_gemm, torchcodec): attention is vLLM's own FlashAttention 3 build (vllm_flash_attn, in its wheel), the GEMMs
# and MoE its own _C and _moe_C or Triton. The structured-output packages (xgrammar, llguidance) are imported by the
# engine's request class whatever the request; fastapi and openai by vllm.entrypoints.llm.
#
# The wheel is trimmed of what an offline engine on Hopper (sm90, the machines' H100 and H200) does not load: the
# FlashAttention 2 build (81 MB compressed; FA3 is chosen on sm90), the vllm-rs server binary, and the vendored
# DeepGEMM and sm100 attention sources (DeepGEMM compiles its kernels with nvcc at run time; without it vLLM takes its
# CUTLASS or Triton FP8 kernels). Installed by unzipping it: its RECORD names the removed files.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root, where build/ lies
VLLM=0.25.0
MCORE=0.19.2
MIB=$((1 << 20))
# The packages vLLM's offline engine imports that the machine may lack (installed there only where absent), at the
# versions vLLM's requirements allow (xgrammar 0.2.5.post1: the last to take apache-tvm-ffi 0.1.9, vLLM's pin; fastapi
# < 0.137: later ones import opentelemetry); cloudpickle and six, which the machines have, for one that lacks them;
# megatron-core for the weight-sync test.
PACKAGES=(
  annotated-doc==0.0.7 annotated-types==0.8.0 cloudpickle==3.1.3 six==1.17.0 anyio==4.16.0 apache-tvm-ffi==0.1.9 cachetools==8.0.2 cbor2==6.3.0
  compressed-tensors==0.17.0 distro==1.9.0 fastapi==0.136.3 h11==0.16.0 httpcore==1.0.9 httpx==0.28.1 httpx2==2.16.2
  jiter==0.13.0 llguidance==1.7.6 loguru==0.7.3 markdown-it-py==4.0.0 mdurl==0.1.2 msgspec==0.22.0 openai==3.57.0
  openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
  pygments==2.21.0 pyzmq==27.3.0 rich==15.0.0 sniffio==1.3.1 starlette==1.10.0 typing-inspection==0.4.5 uvloop==0.23.0
  xgrammar==0.2.5.post1 megatron-core==$MCORE
)
TRIM=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*')

tree_bytes() {  # what every call carries: tracked files and untracked ones not ignored
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

case "${1:-}" in
prepare)
  wheels=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
  mkdir -p build/vllm/download && rm -rf build/vllm/bundle build/vllmpc && mkdir -p build/vllm/bundle
  python3 -m pip download -q "${wheels[@]}" -d build/vllm/download vllm==$VLLM "${PACKAGES[@]}"
  for package in "${PACKAGES[@]}"; do
    name=${package%%==*} version=${package##*==}
    found=$(ls build/vllm/download/ | grep -i "^${name//-/_}-${version}-" | head -1)
    [ -n "$found" ] || { echo "vllm_setup: no wheel of $package in build/vllm/download" >&2; exit 1; }
    cp "build/vllm/download/$found" build/vllm/bundle/
  done
  cp build/vllm/download/vllm-$VLLM-*.whl build/vllm/bundle/
  zip -q -d build/vllm/bundle/vllm-$VLLM-*.whl "${TRIM[@]}"
  (cd build/vllm/bundle && tar -cf ../bundle.tar ./*.whl)
  sha256sum build/vllm/bundle.tar | cut -d' ' -f1 > build/vllm/bundle.sha256
  ls -l build/vllm/bundle
  exec bash "$0" chunks
  ;;
chunks)
  # A chunk call carries the tree and one chunk; 1 MiB kept free. The tar's sha256 travels with each chunk.
  chunk_mb=${CHUNK_MB:-$(( (64 * MIB - $(tree_bytes)) / MIB - 1 ))}
  rm -rf build/vllmpc && mkdir -p build/vllmpc
  split -b "${chunk_mb}M" -d -a 2 build/vllm/bundle.tar build/vllmpc/part_
  for part in build/vllmpc/part_*; do
    n=$((10#${part##*_})); mkdir -p build/vllmpc/$n && mv "$part" build/vllmpc/$n/ && cp build/vllm/bundle.sha256 build/vllmpc/$n/
  done
  tree=$(tree_bytes) last=$(($(ls build/vllmpc | wc -l) - 1))
  echo "bundle $(($(stat -c %s build/vllm/bundle.tar) / MIB)) MiB in $((last + 1)) chunks of at most $chunk_mb MiB;"
  echo "calls, back to back, each carrying the tree ($((tree / MIB)) MiB) too:"
  for n in $(seq 0 "$last"); do
    bytes=$(du -cb build/vllmpc/$n | tail -1 | cut -f1)
    if [ "$n" = "$last" ]; then
      echo "  bash scripts/gpu/run_gpu_tests.sh -k vllm    carry [\"build/vllmpc/$n\"]  ($(((tree + bytes) / MIB)) MiB with the tree)"
    else
      echo "  bash scripts/gpu/vllm_setup.sh chunk $n    carry [\"build/vllmpc/$n\"]  ($(((tree + bytes) / MIB)) MiB with the tree)"
    fi
  done
  ;;
chunk)
  n=${2:?chunk number 0, 1, ...}
  mkdir -p /tmp/vllmpc && cp build/vllmpc/"$n"/* /tmp/vllmpc/ && ls -l /tmp/vllmpc
  ;;
install)
  SITE=${VLLM_SITE:-/tmp/site-vllm}
  mkdir -p /tmp/vllmpc
  for carried in build/vllmpc/*/*; do [ -e "$carried" ] && cp "$carried" /tmp/vllmpc/; done
  tar=/tmp/vllm-bundle.tar
  cat /tmp/vllmpc/part_* > "$tar"
  if [ "$(sha256sum "$tar" | cut -d' ' -f1)" != "$(cat /tmp/vllmpc/bundle.sha256)" ]; then
    echo "vllm_setup: the chunks in /tmp/vllmpc ($(ls /tmp/vllmpc | tr '\n' ' ')) do not make the bundle: carry each of build/vllmpc/* once" >&2
    exit 1
  fi
  rm -rf /tmp/vllm-wheels "$SITE" && mkdir -p /tmp/vllm-wheels "$SITE" && tar -xf "$tar" -C /tmp/vllm-wheels
  # Only what the machine lacks (its own site-packages, PYTHONPATH aside): its transformers' and torch's packages stay.
  missing=$(env -u PYTHONPATH python3 - /tmp/vllm-wheels/*.whl <<'PY'
import sys
from importlib import metadata
for wheel in sys.argv[1:]:
    name = wheel.rsplit("/", 1)[-1].split("-")[0]
    if name == "vllm":
        continue
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(wheel)
PY
)
  echo "vllm_setup: installing into $SITE: vllm $(for w in $missing; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"
  # shellcheck disable=SC2086 (one wheel a word)
  [ -z "$missing" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $missing
  python3 -m zipfile -e /tmp/vllm-wheels/vllm-$VLLM-*.whl "$SITE"
  PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import torch, vllm
from vllm import LLM, SamplingParams
from vllm.vllm_flash_attn import is_fa_version_supported, fa_version_unsupported_reason
print('vllm', vllm.__version__, 'torch', torch.__version__, 'FlashAttention 3:', is_fa_version_supported(3) or fa_version_unsupported_reason(3))"
  ;;
*)
  echo "usage: $0 prepare | chunks | chunk N | install" >&2
  exit 2
  ;;
esac
