#!/usr/bin/env bash
# Both directions of two or more source trees of mconvert side by side on one box, against `cp -r` of the same
# bytes, in one run: to show that a change (a restructuring, a refactor) leaves the speed as it was.
#
#   bash scripts/bench/compare_trees.sh HF_DIR WORK TREE...      # e.g. a `git worktree` of the old commit and .
#
# HF_DIR is an HF model (`python -m mconvert.synthetic --config qwen2.5-7b-instruct --full-size --out hf7` for
# the 7B shape); WORK a directory on the same disk with room for three copies of it. TP=${TP:-2},
# WORKERS=${WORKERS:-2}, ROUNDS=${ROUNDS:-3}, DIRECTIONS=${DIRECTIONS:-hf-to-mcore mcore-to-hf}. The checkpoint
# mcore-to-hf reads is made once, by the first tree. Each round runs, for each direction and each tree in turn
# (their order reversed every other round), `cp -r` of the direction's source and then the tree's conversion,
# each command after reading its source once, then `sync`, the removal of its output and another `sync`: each
# conversion is timed against the copy just before it, so that drift of the disk over the run (and the slot a
# command takes in a round) weighs on both alike. One line per command: seconds until exit, user and system CPU
# seconds, peak RSS, and the conversion's ratio to its copy.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,13p "$0"; exit 2; }
hf=$(realpath "$1") work=$(realpath "$2")
shift 2
trees=()
for tree in "$@"; do trees+=("$(realpath "$tree")"); done
python=${PYTHON:-python3}
mkdir -p "$work"
checkpoint=$work/mc
if [ ! -e "$checkpoint/latest_checkpointed_iteration.txt" ]; then
    rm -rf "$checkpoint"
    PYTHONPATH=${trees[0]} "$python" -m mconvert.cli hf-to-mcore --load-dir "$hf" --save-dir "$checkpoint" --tp "${TP:-2}" --quiet > /dev/null
fi

# Runs "$@" timed after reading $source; prints "seconds user system rss_kb".
timed() {
    local source=$1 out=$2
    shift 2
    cat "$source"/* "$source"/*/* > /dev/null 2>&1 || true
    /usr/bin/time -o "$work/time.txt" -f "%e %U %S %M" "$@" > /dev/null 2>&1
    sync; rm -rf "$out"; sync
    tail -1 "$work/time.txt"
}

echo "| round | command | s | user s | sys s | peak RSS GiB | ratio to cp -r |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "${ROUNDS:-3}"); do
    order=("${trees[@]}")
    if (( round % 2 == 0 )); then
        order=()
        for (( i=${#trees[@]}-1; i>=0; i-- )); do order+=("${trees[$i]}"); done
    fi
    for direction in ${DIRECTIONS:-hf-to-mcore mcore-to-hf}; do
        if [ $direction = hf-to-mcore ]; then source=$hf; else source=$checkpoint; fi
        for tree in "${order[@]}"; do
            read -r copy_s copy_u copy_sys copy_kb <<< "$(timed "$source" "$work/out" cp -r "$source" "$work/out")"
            echo "| $round | cp -r ($direction's source) | $copy_s | $copy_u | $copy_sys | $(awk "BEGIN{printf \"%.2f\", $copy_kb/1048576}") | |"
            read -r s u sys kb <<< "$(PYTHONPATH=$tree timed "$source" "$work/out" "$python" -m mconvert.cli $direction \
                --load-dir "$source" --save-dir "$work/out" --workers "${WORKERS:-2}" --quiet \
                $( [ $direction = hf-to-mcore ] && echo "--tp ${TP:-2}" ))"
            echo "| $round | $direction, $(basename "$tree") | $s | $u | $sys | $(awk "BEGIN{printf \"%.2f\", $kb/1048576}") | $(awk "BEGIN{printf \"%.2f\", $s/$copy_s}") |"
        done
    done
done
