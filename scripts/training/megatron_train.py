"""Training steps from a converted checkpoint through Megatron-LM's own `megatron.training.pretrain`.

    torchrun --nproc-per-node 2 scripts/training/megatron_train.py "${MODEL_ARGS[@]}" \
        --load CKPT --finetune --no-load-optim --no-load-rng --ckpt-format torch_dist \
        --tokenizer-type NullTokenizer --token-file tokens.npy --loss-log losses/ \
        --seq-length 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-5 ...

Everything but the data is Megatron-LM's: its argument parser and validation (`parse_and_validate_args`), its
config containers and model builder (`gpt_config_from_args`, or `hybrid_config_from_args` for a HybridModel's
`--hybrid-layer-pattern`; `pretrain_cfg_container_from_args`, the builder
`pretrain` uses when no model provider is given: the layer spec `--transformer-impl` names), its checkpoint
loading and saving, optimizer and schedules. Like Megatron-LM's pretrain_gpt.py (pretrain_hybrid.py), this file supplies the
datasets provider and the forward step; the data is a token file (`--token-file`, a .npy of int token ids,
shape [samples, seq_length + 1]) that scripts/training/megatron_train_check.py also feeds to transformers, so both sides
compute the loss on the same tokens. Sample i of training is row i modulo the file's rows.

Each rank that computes the loss (last pipeline stage, tensor-parallel rank 0; one per data-parallel rank)
appends one line per micro-batch to `--loss-log`/rank<R>.jsonl as it goes: iteration, summed token loss, token
count. The loss of an iteration is the sum over all those lines of the iteration divided by the token count,
which is Megatron-LM's `lm loss` (pretrain_gpt.py's loss function, token-weighted over micro-batches and
data-parallel ranks).
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch


def add_driver_args(parser):
    group = parser.add_argument_group("mconvert training driver")
    group.add_argument("--token-file", required=True, help=".npy of token ids, shape [samples, seq_length + 1]")
    group.add_argument("--loss-log", required=True, help="folder for rank<R>.jsonl, one line per micro-batch")
    group.add_argument(
        "--config-field", action="append", default=[], metavar="NAME=VALUE",
        help="set args.NAME (a float) after parsing, as megatron_args.sh's 'Not settable by Megatron-LM's flags' "
        "lines say to in pretrain_gpt.py: gpt_config_from_args copies it into the model's config",
    )
    group.add_argument(
        "--dump-weights", help="torch.save the model's parameters and buffers, whole, here at the first forward step "
        "(one data-parallel rank): what the run trains from, to hold its saves against",
    )
    group.add_argument(
        "--dump-local-experts", metavar="FOLDER", help="torch.save each expert-parallel rank's own experts here "
        "(rank<R>.pt) at the first forward step, as that rank holds them, without gathering anything: each under the "
        "model's name with its global expert index (what --dump-weights cannot give where the run shards its weights)",
    )
    return parser


class TokenFile(torch.utils.data.Dataset):
    """`length` training samples cycling over the rows of a token file; the keys pretrain_gpt's batches have."""

    def __init__(self, path: str, seq_length: int, length: int):
        self.rows = np.load(path)
        if self.rows.ndim != 2 or self.rows.shape[1] != seq_length + 1:
            raise SystemExit(
                f"--token-file {path}: shape {self.rows.shape}, expected [samples, {seq_length + 1}] for --seq-length {seq_length}"
            )
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(self.rows[index % len(self.rows)].astype(np.int64))
        return {
            "tokens": row[:-1],
            "labels": row[1:],
            "loss_mask": torch.ones(len(row) - 1, dtype=torch.float32),
            "position_ids": torch.arange(len(row) - 1),
        }


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.training import get_args

    args = get_args()
    return TokenFile(args.token_file, args.seq_length, train_val_test_num_samples[0]), None, None


# Every rank reads the (small) token file itself: no broadcast of batches across tensor-parallel ranks.
datasets_provider.is_distributed = True


def get_batch(data_iterator):
    from megatron.core import parallel_state

    # Middle pipeline stages take their input from the previous stage.
    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return None, None, None, None
    batch = next(data_iterator)
    return tuple(batch[key].cuda(non_blocking=True) for key in ("tokens", "labels", "loss_mask", "position_ids"))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's loss: summed token losses, token count, and the report Megatron-LM averages."""
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    _log_micro_batch(get_args(), loss, num_tokens)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def _log_micro_batch(args, loss: torch.Tensor, num_tokens: torch.Tensor) -> None:
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return  # the other tensor-parallel ranks hold the same loss
    record = {
        "iteration": args.curr_iteration + 1,  # Megatron-LM logs the step it is computing as iteration N+1
        "loss_sum": float(loss.detach()),
        "tokens": int(num_tokens),
        "dtype": str(args.params_dtype).removeprefix("torch."),
        "transformer_impl": args.transformer_impl,
        "padded_vocab_size": args.padded_vocab_size,
    }
    with open(Path(args.loss_log) / f"rank{torch.distributed.get_rank()}.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")


# Whether this process has dumped its weights: each dumps once, at its first forward step (a file's presence would
# tell it only what rank 0 has done).
_dumped = False


def _dump_weights(path: str, model) -> None:
    """The model's tensors by their names in the wrapped model, whole (a sharded DTensor gathered)."""
    from torch.distributed.tensor import DTensor

    try:
        named = [*model.named_parameters(), *model.named_buffers()]
        tensors = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for name, t in named}
    except Exception as e:  # noqa: BLE001 (a wrapper whose tensors cannot be gathered so: said beside, the run goes on)
        Path(path + ".error").write_text(f"{type(e).__name__}: {e}")
        return
    if torch.distributed.get_rank() == 0:
        torch.save(tensors, path)


# An expert's parameter as this rank names it, with its local index: TEGroupedMLP's `linear_fc1.weight3`,
# SequentialMLP's `local_experts.3.linear_fc1.weight` (MTP layers' experts alike).
LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$|(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def global_expert_name(name: str, expert_parallel_rank: int, local_experts: int) -> str | None:
    """`name` with its local expert index made global (expert-parallel rank r holds experts r x local_experts on);
    None for a parameter that is no expert's."""
    found = LOCAL_EXPERT.search(name)
    if found is None:
        return None
    index = expert_parallel_rank * local_experts + int(found[2] or found[4])
    replaced = f"{found[1]}{index}" if found[1] else f"{found[3]}{index}{found[5]}"
    return name[: found.start()] + replaced + name[found.end() :]


def _dump_local_experts(folder: str, model) -> None:
    """This expert-parallel rank's experts (written by the first of its expert-data-parallel ranks) as it holds them:
    no collective, since under Megatron-FSDP at data-parallel size 2 a gather of the sharded weights hung (both ranks
    waiting in NCCL). A weight that is not whole here (sharded over expert data-parallel or expert tensor-parallel
    ranks) is not dumped: rank<R>.error names it and the run goes on."""
    from megatron.core import parallel_state
    from megatron.training import get_args
    from torch.distributed.tensor import DTensor

    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    rank = parallel_state.get_expert_model_parallel_rank()
    local_experts = get_args().num_experts // parallel_state.get_expert_model_parallel_world_size()
    tensors, not_whole = {}, []
    for name, tensor in model.named_parameters():
        if (global_name := global_expert_name(name, rank, local_experts)) is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.shape != tensor.shape or parallel_state.get_expert_tensor_parallel_world_size() > 1:
            not_whole.append(name)
        tensors[global_name] = local.detach().cpu().clone()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if not_whole:
        (out / f"rank{torch.distributed.get_rank()}.error").write_text(f"not whole on this rank: {', '.join(not_whole)}")
    else:
        torch.save(tensors, out / f"rank{torch.distributed.get_rank()}.pt")


def forward_step(data_iterator, model):
    from megatron.training import get_args

    global _dumped
    args = get_args()
    if not _dumped:
        _dumped = True
        if args.dump_local_experts:
            _dump_local_experts(args.dump_local_experts, model)
        if args.dump_weights:
            _dump_weights(args.dump_weights, model)
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator)
    # No attention mask: the layer specs apply the causal mask themselves, as pretrain_gpt.py's default
    # data (create_attention_mask_in_dataloader off) leaves it to them.
    output_tensor = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def main() -> None:
    import megatron.core.datasets.utils as dataset_utils
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        hybrid_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    if not (Path(dataset_utils.__file__).parent / "Makefile").exists():
        # megatron-core's wheel ships the dataset index helpers compiled (helpers_cpp) but not their Makefile:
        # pretrain's `make -C .../megatron/core/datasets` would find nothing to make and exit(1). This driver's
        # data needs no index helpers at all.
        dataset_utils.compile_helpers = lambda: None

    args = parse_and_validate_args(extra_args_provider=add_driver_args)
    for setting in args.config_field:
        name, value = setting.split("=", 1)
        setattr(args, name, float(value))
    Path(args.loss_log).mkdir(parents=True, exist_ok=True)
    # pretrain_hybrid.py's model config for a hybrid layer pattern, pretrain_gpt.py's otherwise.
    model_config = hybrid_config_from_args(args) if args.hybrid_layer_pattern else gpt_config_from_args(args)
    config = pretrain_cfg_container_from_args(args, model_config)
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    # Megatron-LM's rule for TP>1 before Blackwell; its FSDPs require the opposite.
    if not {"--use-megatron-fsdp", "--use-torch-fsdp2"} & set(sys.argv):
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
