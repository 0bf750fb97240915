#!/usr/bin/env bash
# The main job on an embedded default, no network and no GPU: a small Qwen2.5 made from the real config
# (random weights), converted to a TP=2 torch_dist checkpoint, verified against the HF model on CPU ranks,
# and converted back to HF. Everything lands in ./quickstart/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${VENV:-.venv}/bin/activate"
export PYTHONWARNINGS=ignore
rm -rf quickstart
python -m mconvert.synthetic --config qwen2.5-7b-instruct --layers 4 --out quickstart/qwen2.5-hf
mconvert hf-to-mcore --model-size qwen2.5 --tp 2 --load-dir quickstart/qwen2.5-hf --save-dir quickstart/qwen2.5-mcore
mconvert verify --hf quickstart/qwen2.5-hf --mcore quickstart/qwen2.5-mcore --tp 2 --device cpu
mconvert mcore-to-hf --load-dir quickstart/qwen2.5-mcore --save-dir quickstart/qwen2.5-hf-back
