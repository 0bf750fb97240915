"""The launch of Megatron-LM training from a converted checkpoint, written next to its `megatron_args.sh`:
`train.sh` runs torchrun on one node, `train.sbatch` one torchrun per node of a Slurm allocation. Both take
the model's flags from `megatron_args.sh` (sourced when they run, so they follow whatever it holds) and add
the load flags, the training schedule and the data; only the parallel sizes are written into them."""

from __future__ import annotations

import math
from pathlib import Path

from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.flags import TRAINING_SCRIPTS, load_flags

TORCHRUN_SCRIPT = "train.sh"
SBATCH_SCRIPT = "train.sbatch"
GPUS_PER_NODE = 8
MASTER_PORT = 6000


def min_world_size(par: Parallelism) -> int:
    """The fewest GPUs Megatron-LM runs this layout on: the world size must be a multiple of TP x PP (times
    CP, 1 here) and of ETP x EP x PP (the expert grid, megatron.core.parallel_state)."""
    return math.lcm(par.tp * par.pp, par.expert_tp * par.ep * par.pp)


def default_nodes(par: Parallelism, gpus_per_node: int = GPUS_PER_NODE) -> int:
    """The fewest nodes of `gpus_per_node` GPUs whose total is a multiple of the smallest world size."""
    world = min_world_size(par)
    return world // math.gcd(world, gpus_per_node)


# The part both scripts share. NNODES, GPUS_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT are set before it.
_BODY = r"""CHECKPOINT_DIR=${{CHECKPOINT_DIR:-{checkpoint}}}
MEGATRON_LM=${{MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (the directory of {entry})}}
source "$CHECKPOINT_DIR/megatron_args.sh"  # MODEL_ARGS: the flags that describe the converted model

TP={tp} PP={pp} EP={ep} ETP={etp}
CP=${{CP:-1}}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
# Megatron-LM's rules: the world is a multiple of TP x PP x CP, and of the expert grid ETP x EP x PP.
if (( WORLD_SIZE % (TP * PP * CP) || WORLD_SIZE % (ETP * EP * PP) )); then
    echo "error: $WORLD_SIZE GPUs ($NNODES nodes x $GPUS_PER_NODE) is not a multiple of TP*PP*CP=$((TP * PP * CP)) and ETP*EP*PP=$((ETP * EP * PP))" >&2
    exit 1
fi
DATA_PARALLEL=$((WORLD_SIZE / (TP * PP * CP)))

# Megatron-LM (validate_args) requires CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 or CP > 1 on GPUs before
# Blackwell (compute capability 10), unless FSDP runs, which wants it unset.
mapfile -t capabilities < <(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null)
major=${{capabilities[0]:-0}}  # none known: taken as before Blackwell
if (( TP > 1 || CP > 1 )) && (( ${{major%%.*}} < 10 )) \
    && [[ " $* {load_rest} " != *" --use-torch-fsdp2 "* && " $* {load_rest} " != *" --use-megatron-fsdp "* ]]; then
    export CUDA_DEVICE_MAX_CONNECTIONS=1
fi

SCRIPT_ARGS=("$@")
has_flag() {{ [[ " ${{MODEL_ARGS[*]}} ${{SCRIPT_ARGS[*]}} " == *" $1 "* ]]; }}  # given by megatron_args.sh or to this script
LOAD_ARGS=(--load "$CHECKPOINT_DIR" {load_rest})
MICRO_BATCH_SIZE=${{MICRO_BATCH_SIZE:-1}}
TRAIN_ARGS=(
    --save "${{SAVE_DIR:-$CHECKPOINT_DIR-trained}}" --save-interval "${{SAVE_INTERVAL:-1000}}"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "${{GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * DATA_PARALLEL))}}"
    --train-iters "${{TRAIN_ITERS:-1000}}" --lr "${{LR:-1e-5}}" --min-lr "${{MIN_LR:-1e-6}}" --lr-decay-style cosine
    --lr-warmup-iters "${{LR_WARMUP_ITERS:-0}}" --weight-decay 0.1 --clip-grad 1.0
    --log-interval "${{LOG_INTERVAL:-1}}" --eval-iters "${{EVAL_ITERS:-0}}" --eval-interval "${{EVAL_INTERVAL:-1000}}"
)
# Megatron-LM's default gradient accumulation fusion is APEX's CUDA extension: without APEX installed its first
# training forward stops in ColumnParallelLinear.
if ! has_flag --no-gradient-accumulation-fusion && ! python -c "import fused_weight_gradient_mlp_cuda" 2>/dev/null; then
    TRAIN_ARGS+=(--no-gradient-accumulation-fusion)
fi
(( CP > 1 )) && TRAIN_ARGS+=(--context-parallel-size "$CP")
has_flag --seq-length || TRAIN_ARGS+=(--seq-length "${{SEQ_LENGTH:-4096}}")
if ! has_flag --tokenizer-type; then
    if [[ -n ${{TOKENIZER_MODEL:-}} ]]; then
        TRAIN_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
    else
        TRAIN_ARGS+=(--tokenizer-type NullTokenizer)
    fi
fi
if [[ -n ${{DATA_PATH:-}} ]]; then
    DATA_ARGS=(--data-path $DATA_PATH --split "${{SPLIT:-99,1,0}}")  # DATA_PATH: "prefix" or "weight prefix ..."
else
    DATA_ARGS=(--mock-data)
fi
# Arguments given to this script come last: they win over the defaults above and MODEL_ARGS.
PRETRAIN=("$MEGATRON_LM/{entry}" "${{TRAIN_ARGS[@]}}" "${{DATA_ARGS[@]}}" "${{LOAD_ARGS[@]}}" "${{MODEL_ARGS[@]}}" "$@")
"""

_TORCHRUN = r"""#!/bin/bash
# Fine-tunes the checkpoint in this directory with Megatron-LM on this node: torchrun, one process per GPU.
#   MEGATRON_LM=/path/to/Megatron-LM bash {script} [more {entry} flags]
# Environment: GPUS_PER_NODE (default {gpus}), DATA_PATH (mock data when unset), TOKENIZER_MODEL, TRAIN_ITERS,
# MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, LR, SEQ_LENGTH, EVAL_ITERS, EVAL_INTERVAL, SAVE_DIR, CP, CHECKPOINT_DIR.
# Written by mconvert.
set -euo pipefail
NNODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT=${{MASTER_PORT:-{port}}}
GPUS_PER_NODE=${{GPUS_PER_NODE:-{gpus}}}
{body}
exec python -m torch.distributed.run --nnodes 1 --nproc-per-node "$GPUS_PER_NODE" --node-rank 0 \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "${{PRETRAIN[@]}}"
"""

_SBATCH = r"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --exclusive
# Fine-tunes the checkpoint in this directory with Megatron-LM: one srun task per node, each running torchrun
# with one process per GPU. The world size must be a multiple of TP x PP = {tp_pp}{expert_rule}.
#   MEGATRON_LM=/path/to/Megatron-LM sbatch [--nodes N] {script} [more {entry} flags]
# Environment as for train.sh. Written by mconvert.
set -euo pipefail
NNODES=${{SLURM_NNODES:?run under Slurm: sbatch {script}}}
GPUS_PER_NODE=${{GPUS_PER_NODE:-{gpus}}}
# All of scontrol's output is read (`| head` could kill it with SIGPIPE, which pipefail turns into a failure).
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${{hosts[0]:?scontrol show hostnames gave no host}}
MASTER_PORT=${{MASTER_PORT:-{port}}}
{body}
export MASTER_ADDR MASTER_PORT
# One task per node; its node rank is Slurm's node id, read inside the task (hence the single quotes).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'exec python -m torch.distributed.run \
    --nnodes "$0" --nproc-per-node "$1" --node-rank "$SLURM_NODEID" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "${{@:2}}"' "$NNODES" "$GPUS_PER_NODE" "${{PRETRAIN[@]}}"
"""


def write_launch(directory: Path, final_dir: Path, par: Parallelism, ckpt_format: str = "torch_dist") -> None:
    """Write train.sh and train.sbatch into `directory`, for the checkpoint in `ckpt_format` that will live at
    `final_dir`."""
    final_dir = final_dir.absolute()
    entry = TRAINING_SCRIPTS[par.model_class]
    load_rest = " ".join(load_flags(final_dir, ckpt_format)[1:])  # all but --load, which names the variable
    body = _BODY.format(
        checkpoint=final_dir, tp=par.tp, pp=par.pp, ep=par.ep, etp=par.expert_tp, entry=entry, load_rest=load_rest
    )
    expert_rule = f" and of ETP x EP x PP = {par.expert_tp * par.ep * par.pp}" if par.ep > 1 else ""
    common = dict(gpus=GPUS_PER_NODE, port=MASTER_PORT, body=body, entry=entry)
    torchrun = directory / TORCHRUN_SCRIPT
    torchrun.write_text(_TORCHRUN.format(script=final_dir / TORCHRUN_SCRIPT, **common))
    sbatch = directory / SBATCH_SCRIPT
    sbatch.write_text(_SBATCH.format(
        script=final_dir / SBATCH_SCRIPT, name=final_dir.name, nodes=default_nodes(par),
        tp_pp=par.tp * par.pp, expert_rule=expert_rule, **common,
    ))
    for script in (torchrun, sbatch):
        script.chmod(0o755)
