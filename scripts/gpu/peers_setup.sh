#!/usr/bin/env bash
# The peer converters for gpu_peers.py on the GPU machine (no network there), one pip --target folder each:
#   /tmp/peers/mb       Megatron-Bridge 0.6.2, with the transformers (5.12.1) and tokenizers its pins ask for,
#                       nvidia-modelopt (its save path imports it; 0.46.0: its pinned 0.46.0rc1 is not served) and
#                       what those import at load (pulp, omegaconf, hydra-core, antlr4, datasets)
#   /tmp/peers/sw       ms-swift 4.6.0 with mcore-bridge 1.6.5 (modelscope, cryptography, peft 0.20 within its pins, ...)
#   /tmp/peers/mbridge  mbridge 0.15.1
#   /tmp/peers/stubs    a stand-in for megatron-energon (scripts/gpu/peer_stubs: Megatron-Bridge's save path imports it
#                       at load and never calls it; the real one drags in about ten packages more)
# All three import Transformer Engine and megatron-core: install those first (gpu_te_setup.sh) into /tmp/site.
#
#   bash scripts/gpu/peers_setup.sh prepare    # here: the wheels into build/peers/wheels/{mb,shared,sw,mbridge,kernels}
#   bash scripts/gpu/peers_setup.sh install    # there, with those folders carried (or PEER_WHEELS naming a copy)
#
# One pip call a folder: a second `pip install --target` into a folder holding megatron/ skips it silently.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${PEER_WHEELS:-build/peers/wheels}
DEST=${PEERS_DIR:-/tmp/peers}
case "${1:-}" in
prepare)
  get() { local dir=$1; shift; mkdir -p "$W/$dir"; python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$W/$dir" "$@"; }
  get mb megatron-bridge==0.6.2 transformers==5.12.1 tokenizers==0.22.2 nvidia-modelopt==0.46.0 pulp==3.3.2 omegaconf==2.3.0 \
    hydra-core==1.3.8
  # An sdist only: built here, in pip's own build environment when this python lacks `wheel`.
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$W/mb" antlr4-python3-runtime==4.9.3 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w "$W/mb" antlr4-python3-runtime==4.9.3
  get shared datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19
  get sw ms-swift==4.6.0 mcore-bridge==1.6.5 modelscope==1.40.2 modelscope-hub==0.5.1 cryptography==50.0.2 cffi==2.1.1 \
    pycparser==3.12 json-repair==0.64.6 peft==0.20.0
  get mbridge mbridge==0.15.1
  # The kernels' packages the new families' models import when built (peers-new): flash-linear-attention for gated
  # delta-net, mamba_ssm for Nemotron-H's Mamba-2 layers (the wheel built without its CUDA extension that .whl holds for
  # the nemotron-h stage, copied from there when present).
  get kernels flash-linear-attention==0.5.2 fla-core==0.5.2 einops==0.8.2
  cp .whl/mamba_ssm-*.whl "$W/kernels/" 2>/dev/null || echo "no .whl/mamba_ssm-*.whl: peers-new takes it from .whl there, or Nemotron-H fails" >&2
  du -sh "$W"/*
  ;;
install)
  pipt() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$@"; }
  mkdir -p "$DEST/stubs" && cp -r scripts/gpu/peer_stubs/megatron "$DEST/stubs/"
  rm -rf "${DEST:?}/mb" "$DEST/sw" "$DEST/mbridge"
  pipt "$DEST/mb" "$W"/mb/*.whl "$W"/shared/*.whl
  pipt "$DEST/sw" "$W"/sw/*.whl "$W"/shared/*.whl
  pipt "$DEST/mbridge" "$W"/mbridge/*.whl
  SITE=${TE_SITE:-/tmp/site}
  PYTHONPATH=$DEST/mb:$DEST/stubs:$SITE python3 -c "from megatron.bridge import AutoBridge; import megatron.bridge.training.model_load_save, transformers; print('megatron-bridge ok, transformers', transformers.__version__)"
  PYTHONPATH=$DEST/sw:$SITE python3 -c "import swift.megatron.pipelines.export.export, mcore_bridge; print('ms-swift ok, mcore-bridge', mcore_bridge.__version__)"
  PYTHONPATH=$DEST/mbridge:$SITE python3 -c "import mbridge; print('mbridge ok')"
  ;;
*)
  echo "usage: $0 prepare|install" >&2
  exit 2
  ;;
esac
