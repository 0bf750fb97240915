"""scripts/training/megatron_train.py on CPU, as far as Megatron-LM runs there (its `pretrain` asserts CUDA):
Megatron-LM's own parser and config builders take the driver's command line (a converted checkpoint's MODEL_ARGS
plus the load and data flags), and the driver's datasets provider and forward step, on a model Megatron-LM's own
builder makes from those args and the converted weights, give transformers' loss on the same tokens. Needs
megatron-core >= 0.19 (`megatron.training`, Python 3.12); skipped elsewhere, except where
MCONVERT_REQUIRE_MEGATRON_LM=1 (scripts/test.sh's Python 3.12 run) makes its absence fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training.argument_utils", reason="Megatron-LM's training package: the Python 3.12 environment")

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.mcore.parallelism import Parallelism  # noqa: E402
from mconvert.verify.distributed import run_ranks  # noqa: E402
from mconvert.verify.megatron_lm import script_arrays  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "training"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def driver_command_line(ckpt: Path, tokens: Path, log: Path, seq_length: int, rows: int) -> list[str]:
    return [
        *script_arrays(ckpt, "MODEL_ARGS"),  # MODEL_ARGS, exactly as the converter wrote them
        "--load", str(ckpt), "--finetune", "--no-load-optim", "--no-load-rng", "--ckpt-format", "torch_dist",
        "--dist-ckpt-strictness", "raise_unexpected", "--tokenizer-type", "NullTokenizer",
        "--token-file", str(tokens), "--loss-log", str(log), "--seq-length", str(seq_length),
        "--micro-batch-size", "1", "--global-batch-size", str(rows), "--train-iters", "1", "--lr", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
    ]


def driver_loss_on_cpu(argv: list[str]) -> tuple[float, int]:
    """In each CPU rank: Megatron-LM parses `argv`, builds the model from the args with its own builder, the
    converted weights are loaded into it, and the driver's data and forward step run one global batch."""
    import megatron.training.arguments
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.fusions import fused_softmax
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    from mconvert.mcore.checkpoint import iteration_dir

    # Megatron-LM reads the GPU generation for its CUDA_DEVICE_MAX_CONNECTIONS rule; Hopper's (9) here.
    megatron.training.arguments.get_device_arch_version = lambda: 9
    # With no attention mask (pretrain_gpt.py's default data) the local attention makes its causal mask with
    # device="cuda"; the same mask on the CPU.
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    driver = _script("megatron_train")
    # Megatron-LM reads the world from torchrun's environment, and its CUDA_DEVICE_MAX_CONNECTIONS rule from it
    # too (set here: ranks come from a fork server, whose environment predates this test's).
    os.environ.update(
        RANK=str(torch.distributed.get_rank()), WORLD_SIZE=str(torch.distributed.get_world_size()), CUDA_DEVICE_MAX_CONNECTIONS="1"
    )
    sys.argv = ["megatron_train.py", *argv]
    args = parse_and_validate_args(extra_args_provider=driver.add_driver_args)
    Path(args.loss_log).mkdir(parents=True, exist_ok=True)
    args.curr_iteration = 0
    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    state = dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(iteration_dir(Path(args.load))), strict=StrictHandling.RAISE_UNEXPECTED
    )
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    train, _, _ = driver.datasets_provider([args.global_batch_size, 0, 0])
    batches = iter(torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size))
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(args.global_batch_size // args.micro_batch_size):
            output, loss_func = driver.forward_step(batches, model)
            loss, tokens, _ = loss_func(output)
            total, count = total + float(loss), count + int(tokens)
    return total, count


def experts_as_megatron_names_them(hf: Path) -> dict[str, torch.Tensor]:
    """Every expert's fc1 ([gate; up]) and fc2, from the HF tensors, under the names of megatron-core's SequentialMLP
    (the local spec's): an MTP layer's (HF layer num_hidden_layers + m) under its mtp_model_layer."""
    from safetensors.torch import load_file

    tensors = {name: t for path in hf.glob("*.safetensors") for name, t in load_file(path).items()}
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    experts = {}
    for name in tensors:
        if not (found := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", name)):
            continue
        layer, expert, hf_expert = int(found[1]), found[2], name.removesuffix("gate_proj.weight")
        scope = f"decoder.layers.{layer}." if layer < layers else f"mtp.layers.{layer - layers}.mtp_model_layer."
        fc1 = torch.cat([tensors[hf_expert + "gate_proj.weight"], tensors[hf_expert + "up_proj.weight"]])
        experts[f"{scope}mlp.experts.local_experts.{expert}.linear_fc1.weight"] = fc1
        experts[f"{scope}mlp.experts.local_experts.{expert}.linear_fc2.weight"] = tensors[hf_expert + "down_proj.weight"]
    return experts


# Dense under TP, and MoE under EP, on 2 CPU ranks; GLM-4.5 with the multi-token prediction layer the hub's
# checkpoints hold (--mtp-num-layers 1), sigmoid routing with the expert bias, fp32 routing and partial rope,
# through Megatron-LM's own builders (DeepSeek's MLA needs Transformer Engine there).
CASES = {
    # name: (config, parallelism, with the config's multi-token prediction layers)
    "qwen2-tp2": ("qwen2.5-0.5b", Parallelism(tp=2), False),
    "qwen3_moe-ep2": ("qwen3-30b-a3b", Parallelism(ep=2), False),
    "glm4_moe-mtp-ep2": ("glm-4.5-air", Parallelism(ep=2), True),
    # Its q/k norms across heads from mconvert's layer spec, which Megatron-LM's builder loads by --spec.
    "minimax_m2-tp2ep2": ("minimax-m2.7", Parallelism(tp=2, ep=2), False),
}


@pytest.mark.parametrize("case", CASES)
def test_driver_loss_equals_transformers(case, hf_model_factory, tmp_path, monkeypatch):
    config, parallelism, mtp = CASES[case]
    hf = Path(hf_model_factory(config, mtp=mtp))
    ckpt = tmp_path / "mcore"
    convert_hf_to_mcore(hf, ckpt, parallelism=parallelism)
    check = _script("megatron_train_check")
    rows, seq_length = 2, 12
    check.write_tokens(hf, rows, seq_length, tmp_path / "tokens.npy")
    argv = driver_command_line(ckpt, tmp_path / "tokens.npy", tmp_path / "log", seq_length, rows)
    assert ("--mtp-num-layers" in argv) == mtp
    if not importlib.util.find_spec("transformer_engine"):
        # Without Transformer Engine: the local spec, and off what Megatron-LM defaults to and only TE provides
        # (rope fusion, the persistent layer norm); grouped GEMM experts are TE's (the local spec's are the legacy
        # GroupedMLP of the CUDA-only grouped_gemm package), so SequentialMLP, which loads the same keys.
        argv = [arg for arg in argv if arg != "--moe-grouped-gemm"]
        argv += ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm"]
    # On CPU: weights made on the CPU, no fused weight-gradient kernels, and the token dispatcher that runs on
    # gloo (alltoall's makes a CUDA stream; dispatchers only move tokens to their experts and back).
    argv += ["--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--moe-token-dispatcher-type", "allgather"]
    if parallelism.ep > 1 and parallelism.tp == 1:
        argv += ["--dump-local-experts", str(tmp_path / "experts")]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    total, count = run_ranks(
        driver_loss_on_cpu, argv, tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, etp=parallelism.etp
    )
    if parallelism.ep > 1 and parallelism.tp == 1:
        # Each expert-parallel rank's own experts, under their global indices: together every expert of the model,
        # the MTP layer's included, as the HF model holds it.
        dumped = [torch.load(path, weights_only=True) for path in sorted((tmp_path / "experts").glob("rank*.pt"))]
        assert len(dumped) == parallelism.ep and not set(dumped[0]) & set(dumped[1])
        dumped = {name: tensor for rank in dumped for name, tensor in rank.items()}
        expected = experts_as_megatron_names_them(hf)
        assert dumped.keys() == expected.keys() and (".mtp_model_layer." in str(list(expected))) == mtp
        assert all(torch.equal(dumped[name], tensor) for name, tensor in expected.items())
    assert count == rows * seq_length
    losses, info = check.megatron_losses(tmp_path / "log")
    assert info["dtype"] == "float32" and info["padded_vocab_size"] > 1000
    tokens = np.load(tmp_path / "tokens.npy")
    reference = check.hf_loss(hf, tokens, torch.float32, "cpu", info["padded_vocab_size"])
    assert abs(total / count - reference) <= check.FP32_LOSS_TOLERANCE
    # Megatron's padding logits are in its loss: without them the two differ by far more than the tolerance.
    assert abs(total / count - check.hf_loss(hf, tokens, torch.float32, "cpu")) > 100 * check.FP32_LOSS_TOLERANCE
    # The per-rank log the check reads gives the same loss.
    # (Here every rank runs the whole batch; the check's token weighting makes that the same mean.)
    assert abs(losses[1] - reference) <= check.FP32_LOSS_TOLERANCE


def test_export_check_is_bit_exact(hf_model_factory, tmp_path):
    """The check's export comparison passes for mconvert's own round trip and fails for one changed element."""
    from safetensors.torch import load_file, save_file

    hf = Path(hf_model_factory("qwen2.5-0.5b"))
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    check = _script("megatron_train_check")
    result = check.compare_export(hf, tmp_path / "mcore")
    assert result["passed"] and result["tensors"] > 0, result
    changed = tmp_path / "changed"
    changed.mkdir()
    for path in hf.iterdir():
        (changed / path.name).write_bytes(path.read_bytes())
    shard = sorted(changed.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, shard, metadata={"format": "pt"})
    result = check.compare_export(changed, tmp_path / "mcore")
    assert not result["passed"] and result["differing"] == [name]
