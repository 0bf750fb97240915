#!/usr/bin/env bash
# mcore-to-hf at 8 workers with --max-shard-size 5GB and 2GB side by side (two rounds, the order swapped in the
# second, `cp -r` of the checkpoint before each round), on a random model of $MODEL's shape (default the whole
# Qwen2.5-7B) made here and converted once with hf-to-mcore; seconds, CPU seconds and peak memory of each run
# (scripts/bench/memory_split.py) appended to $OUT/shards.txt as measured. Needs room for two copies of the model
# (the HF source is removed once the checkpoint is made).
#
#   OUT=DIR bash scripts/bench/shard_sizes.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore
: "${OUT:?OUT must name the folder for the results}"
work=${WORK:-/tmp/shard-sizes} model=${MODEL:-qwen2.5-7b-instruct} results=$OUT/shards.txt
mkdir -p "$work" "$OUT"
(cd scripts/bench && python3 -c "from pathlib import Path; from bench_convert import make_source; make_source('$model', Path('$work'))") > /dev/null 2>&1
python3 -P -m mconvert hf-to-mcore --load-dir "$work/$model" --save-dir "$work/mc" --workers 8 --quiet > /dev/null && rm -rf "${work:?}/$model"
echo "$model: checkpoint made at +${SECONDS} s" >> "$results"
for order in "5GB 2GB" "2GB 5GB"; do
  rm -rf "$work/copy"; sync; cat "$work"/mc/release/* > /dev/null
  /usr/bin/time -o "$results" -a -f "cp -r: %e s" cp -r "$work/mc" "$work/copy"; rm -rf "$work/copy"
  for size in $order; do
    rm -rf "$work/back"; sync; cat "$work"/mc/release/* > /dev/null
    echo -n "mcore-to-hf --workers 8 --max-shard-size $size: " >> "$results"
    python3 scripts/bench/memory_split.py -- python3 -P -m mconvert mcore-to-hf --load-dir "$work/mc" --save-dir "$work/back" \
      --workers 8 --max-shard-size "$size" --quiet 2>&1 | tail -1 >> "$results"
    echo "  files: $(ls "$work"/back/*.safetensors | wc -l)" >> "$results"
  done
done
rm -rf "$work"
cat "$results"
