"""The peers' way to make a torch_dist checkpoint from HF weights, for comparison in bench_scaling.py: the HF
weights loaded in memory, megatron-core's GPTModel built, the weights copied into its parameters, and
megatron-core's `dist_checkpointing.save`. Run as one torchrun rank (TP=1):

    torchrun --standalone --nproc-per-node 1 scripts/bench/peers_save.py HF_DIR OUT_DIR
"""

import sys
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from safetensors.torch import load_file

from mconvert.converters.state_dict import hf_to_mcore_state_dict
from mconvert.dtypes import torch_dtype
from mconvert.formats.hf_checkpoint import read_hf_config
from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.verify.distributed import run_ranks
from mconvert.verify.megatron_model import build_gpt_model


def save(hf_dir: str, out: str) -> None:
    config = read_hf_config(Path(hf_dir), "HF_DIR")
    _, spec = get_mapping(config)
    hf: dict[str, torch.Tensor] = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(path))
    whole = hf_to_mcore_state_dict(hf, config)
    args = megatron_args(spec, Parallelism(), spec.dtype, "local")
    model = build_gpt_model(args, torch_dtype(spec.dtype), True, True, transformer_impl="local", perform_initialization=False)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)  # fc1's gate and up become tensors of their own (views of the parameter)
    with torch.no_grad():
        for tensor in nested_values(sharded):
            if isinstance(tensor, ShardedTensor) and tensor.key in whole:
                sizes = (1,) * tensor.prepend_axis_num + tuple(tensor.local_shape)
                index = tuple(slice(o, o + s) for o, s in zip(tensor.global_offset, sizes))
                tensor.data.copy_(whole[tensor.key][index].reshape(tensor.data.shape))
    del whole, hf
    release = Path(out) / "release"
    release.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0}, str(release))
    (Path(out) / "latest_checkpointed_iteration.txt").write_text("release")


if __name__ == "__main__":
    run_ranks(save, sys.argv[1], sys.argv[2], timeout_s=3000)
