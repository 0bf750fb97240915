"""train.sh and train.sbatch, written next to megatron_args.sh: run here with stand-ins for the Slurm commands,
nvidia-smi and the per-node `python`, which record what they were asked to run; torch.distributed.run's own
parser reads the launcher arguments and Megatron-LM's own parser (megatron.training, in the Python 3.12
environment that has it) the training arguments."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from mconvert.cli import main
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.launch import default_nodes, min_world_size

# A Python whose megatron-core ships megatron.training (0.19 does; 0.16 does not): scripts/test.sh names the one
# scripts/install312.sh makes.
MEGATRON_PYTHON = Path(os.environ.get("MEGATRON_TRAINING_PYTHON", Path(__file__).resolve().parents[1] / ".venv312/bin/python"))

STAND_INS = {
    # The first node of the allocation is the rendezvous host.
    "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "node-a\\nnode-b\\nnode-c\\n"',
    # One task per node, as --ntasks-per-node=1 asks: the command once per node, with that node's id.
    "srun": 'while [[ $1 == --* ]]; do shift; done\n'
    'for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" || exit; done',
    "nvidia-smi": 'echo "$COMPUTE_CAP"',
    # `python -c` is the script's probe for APEX's extension: found when the test sets APEX.
    "python": '[ "$1" = -c ] && exec test -n "${APEX:-}"\n'
    'out="$RECORD/node-${SLURM_NODEID:-0}"\nprintf "%s\\n" "$@" > "$out.argv"\n'
    'echo "${CUDA_DEVICE_MAX_CONNECTIONS:-unset}" > "$out.connections"',
}


@pytest.fixture(scope="module")
def checkpoint(hf_model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("launch") / "qwen-tp2"
    assert main(["hf-to-mcore", "--load-dir", str(hf_model_factory("qwen2.5-7b-instruct")), "--save-dir", str(out), "--tp", "2", "--quiet"]) == 0
    return out


def launch(checkpoint: Path, tmp_path: Path, script: str, *args: str, nodes: int = 2, gpus: int = 4, compute_cap: str | None = "9.0", **env_extra: str):
    """Run `script` as sbatch (or a user) would; per node, the argv its torchrun got and CUDA_DEVICE_MAX_CONNECTIONS."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(exist_ok=True)
    record.mkdir(exist_ok=True)
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    if compute_cap is None:  # no nvidia-smi at all
        (bin_dir / "nvidia-smi").unlink()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "RECORD": str(record), "COMPUTE_CAP": compute_cap or "",
        "MEGATRON_LM": "/opt/Megatron-LM", "GPUS_PER_NODE": str(gpus),
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": "node-[a-c]", **env_extra,
    }
    run = subprocess.run(["bash", str(checkpoint / script), *args], env=env, capture_output=True, text=True)
    nodes_seen = {}
    for argv in sorted(record.glob("*.argv")):
        node = argv.name.split(".")[0]
        nodes_seen[node] = (argv.read_text().splitlines(), (record / f"{node}.connections").read_text().strip())
        argv.unlink()
    return run, nodes_seen


def torchrun_args(argv: list[str]):
    assert argv[:2] == ["-m", "torch.distributed.run"]
    return get_args_parser().parse_args(argv[2:])


def megatron_args(training_args: list[str], world_size: int) -> dict:
    """What Megatron-LM's own argument parser and validation make of pretrain_gpt.py's arguments at this world
    size, and the sample counts its `pretrain` computes from them before building the data iterators."""
    if not MEGATRON_PYTHON.exists():
        assert "MEGATRON_TRAINING_PYTHON" not in os.environ, f"MEGATRON_TRAINING_PYTHON: no {MEGATRON_PYTHON}"
        pytest.skip(f"no {MEGATRON_PYTHON} with megatron.training (set MEGATRON_TRAINING_PYTHON)")
    code = (
        "import json, sys\n"
        "from mconvert.verify.megatron_lm import parse_megatron_lm_args\n"
        "from megatron.training.global_vars import set_args\n"
        "from megatron.training.training import get_train_valid_test_num_samples\n"
        "a = parse_megatron_lm_args(json.loads(sys.argv[1]), int(sys.argv[2]))\n"
        "set_args(a)\n"
        "samples = get_train_valid_test_num_samples()\n"
        "print(json.dumps({'samples': samples, **{k: getattr(a, k) for k in ('load', 'ckpt_format', 'finetune', 'no_load_optim', "
        "'no_load_rng', 'tensor_model_parallel_size', 'pipeline_model_parallel_size', 'num_layers', 'hidden_size', 'mock_data', "
        "'tokenizer_type', 'train_iters', 'global_batch_size', 'seq_length', 'save', 'gradient_accumulation_fusion')}}))\n"
    )
    run = subprocess.run([str(MEGATRON_PYTHON), "-c", code, json.dumps(training_args), str(world_size)],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_sbatch_runs_one_torchrun_per_node_with_megatron_flags(checkpoint, tmp_path):
    text = (checkpoint / "train.sbatch").read_text()
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert 'source "$CHECKPOINT_DIR/megatron_args.sh"' in text
    run, nodes = launch(checkpoint, tmp_path, "train.sbatch", "--train-iters", "3")
    assert run.returncode == 0, run.stderr
    assert sorted(nodes) == ["node-0", "node-1"]
    for rank, (argv, connections) in enumerate(nodes[f"node-{rank}"] for rank in range(2)):
        launcher = torchrun_args(argv)
        assert (launcher.nnodes, launcher.nproc_per_node, launcher.node_rank) == ("2", "4", rank)
        assert (launcher.master_addr, launcher.master_port) == ("node-a", 6000)
        assert launcher.training_script == "/opt/Megatron-LM/pretrain_gpt.py"
        assert connections == "1"  # TP 2 on a Hopper
    args = megatron_args(launcher.training_script_args, world_size=8)
    assert args["load"] == str(checkpoint) and args["ckpt_format"] == "torch_dist"
    assert args["finetune"] and args["no_load_optim"] and args["no_load_rng"]
    assert (args["tensor_model_parallel_size"], args["num_layers"], args["hidden_size"]) == (2, 2, 64)
    assert args["train_iters"] == 3  # the script's own arguments win
    assert args["global_batch_size"] == 4  # one micro-batch per data-parallel rank: 8 GPUs / TP 2
    assert args["mock_data"] and args["tokenizer_type"] == "NullTokenizer" and args["seq_length"] == 4096
    assert args["samples"] == [3 * 4, 0, 0]  # no evaluation unless EVAL_ITERS is set
    assert not args["gradient_accumulation_fusion"]  # no APEX here


def test_gradient_accumulation_fusion_stays_on_where_apex_is_installed(checkpoint, tmp_path):
    run, nodes = launch(checkpoint, tmp_path, "train.sh", gpus=2, APEX="1")
    assert run.returncode == 0, run.stderr
    args = megatron_args(torchrun_args(nodes["node-0"][0]).training_script_args, world_size=2)
    assert args["gradient_accumulation_fusion"]


def test_torchrun_line_on_one_node(checkpoint, tmp_path):
    run, nodes = launch(checkpoint, tmp_path, "train.sh", gpus=2)
    assert run.returncode == 0, run.stderr
    launcher = torchrun_args(nodes["node-0"][0])
    assert (launcher.nnodes, launcher.nproc_per_node, launcher.node_rank, launcher.master_addr) == ("1", "2", 0, "localhost")
    assert launcher.training_script_args[launcher.training_script_args.index("--load") + 1] == str(checkpoint)


@pytest.mark.parametrize(
    "args, compute_cap, expected",
    [((), "9.0", "1"), ((), "8.0", "1"), ((), "10.0", "unset"), ((), "12.0", "unset"), ((), None, "1"),
     (("--use-torch-fsdp2",), "9.0", "unset"), (("--use-megatron-fsdp",), "8.0", "unset")],
)
def test_cuda_device_max_connections_exactly_where_megatron_requires_it(checkpoint, tmp_path, args, compute_cap, expected):
    run, nodes = launch(checkpoint, tmp_path, "train.sh", *args, gpus=2, compute_cap=compute_cap)
    assert run.returncode == 0, run.stderr
    assert nodes["node-0"][1] == expected


def test_tp1_leaves_connections_alone_unless_cp(hf_model_factory, tmp_path):
    out = tmp_path / "tp1"
    assert main(["hf-to-mcore", "--load-dir", str(hf_model_factory("qwen2.5-7b-instruct")), "--save-dir", str(out), "--quiet"]) == 0
    _, nodes = launch(out, tmp_path, "train.sh", gpus=2)
    assert nodes["node-0"][1] == "unset"
    run, nodes = launch(out, tmp_path, "train.sh", gpus=2, CP="2")
    assert nodes["node-0"][1] == "1"
    assert "--context-parallel-size\n2\n" in "\n".join(nodes["node-0"][0]) + "\n"


def test_world_size_not_a_multiple_is_refused(checkpoint, tmp_path):
    run, nodes = launch(checkpoint, tmp_path, "train.sbatch", nodes=1, gpus=3)
    assert run.returncode == 1 and not nodes
    assert "3 GPUs (1 nodes x 3) is not a multiple of TP*PP*CP=2" in run.stderr


def test_default_nodes_hold_a_multiple_of_the_model_and_expert_grids():
    assert min_world_size(Parallelism(tp=8, pp=2)) == 16 and default_nodes(Parallelism(tp=8, pp=2)) == 2
    assert min_world_size(Parallelism(tp=2, ep=8, etp=1)) == 8 and default_nodes(Parallelism(tp=2, ep=8, etp=1)) == 1
    assert min_world_size(Parallelism(tp=4, pp=3, ep=2, etp=4)) == 24 and default_nodes(Parallelism(tp=4, pp=3, ep=2, etp=4)) == 3


def test_an_fsdp_dtensor_conversions_train_sh_runs_megatron_fsdp(hf_model_factory, tmp_path):
    """Its LOAD_ARGS make the run Megatron-FSDP's, which wants CUDA_DEVICE_MAX_CONNECTIONS unset even at TP 2 before
    Blackwell; they resume (no --finetune), as measured on the GPU (docs/verification.md)."""
    out = tmp_path / "fsdp"
    hf = str(hf_model_factory("qwen2.5-7b-instruct"))
    assert main(["hf-to-mcore", "--load-dir", hf, "--save-dir", str(out), "--tp", "2", "--format", "fsdp_dtensor", "--quiet"]) == 0
    run, nodes = launch(out, tmp_path, "train.sh", gpus=2, compute_cap="9.0")
    assert run.returncode == 0, run.stderr
    argv, connections = nodes["node-0"]
    assert connections == "unset"
    script_args = torchrun_args(argv).training_script_args
    assert "--use-megatron-fsdp" in script_args and "--no-strict-fsdp-dtensor-load" in script_args
    assert script_args[script_args.index("--ckpt-format") + 1] == "fsdp_dtensor" and "--finetune" not in script_args
