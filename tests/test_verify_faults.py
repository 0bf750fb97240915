"""`mconvert verify`'s own calibration: subtle faults written into a converted checkpoint, each of which a faulty
conversion could make, fail it in fp32 and in bf16 at the thresholds it ships (mconvert/verify/compare.py).

One Qwen3-MoE (GQA, q/k norms, experts; weights at std 0.1) converted at TP 1, a copy of the checkpoint per fault
with the fault written over the stored bytes, and one set of CPU ranks that loads every copy as verify does
(`megatron_outputs`) in fp32 and in bf16; verify's `compare` decides each, against the HF model's fp32 logits (and in
bf16 its own bf16 run), on verify's built-in prompts. The faithful checkpoint passes both in the same run."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mconvert.dtypes import as_torch
from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.mcore.parallelism import Parallelism
from mconvert.verify.distributed import run_ranks
from mconvert.verify.hf_side import hf_outputs
from mconvert.verify.run import DTYPES, builtin_prompts, compare, megatron_outputs

HEADS, GROUPS, HEAD_DIM = 4, 2, 32  # the shrunk Qwen3-30B-A3B's
QKV = "decoder.layers.self_attention.linear_qkv.weight"  # [layers, groups x (heads/groups + 2) x head_dim, hidden]
ROWS_PER_GROUP = (HEADS // GROUPS + 2) * HEAD_DIM


def exchanged(tensor: torch.Tensor, first: tuple, second: tuple) -> torch.Tensor:
    tensor[first], tensor[second] = tensor[second].clone(), tensor[first].clone()
    return tensor


def interleaved_rope_rows(qkv: torch.Tensor) -> torch.Tensor:
    """Layer 0's query and key heads with their rows in the interleaved rope layout ([x0, x16, x1, x17, ...]) where
    megatron-core (and transformers) pair x_i with x_{i+16}: what a conversion that took the model for one of the
    other layout would write. The q/k norm weights are permuted alike (below), so that only rope sees it."""
    order = torch.stack([torch.arange(HEAD_DIM // 2), torch.arange(HEAD_DIM // 2, HEAD_DIM)], dim=1).flatten()
    for group in range(GROUPS):
        for head in range(HEADS // GROUPS + 1):  # the group's query heads, then its key head
            start = group * ROWS_PER_GROUP + head * HEAD_DIM
            qkv[0, start : start + HEAD_DIM] = qkv[0, start : start + HEAD_DIM][order].clone()
    return qkv


def interleaved_norm(weight: torch.Tensor) -> torch.Tensor:
    order = torch.stack([torch.arange(HEAD_DIM // 2), torch.arange(HEAD_DIM // 2, HEAD_DIM)], dim=1).flatten()
    weight[0] = weight[0][order].clone()
    return weight


def dropped(weight: torch.Tensor) -> torch.Tensor:
    """Layer 1's weight left at megatron-core's init (ones): a norm the conversion did not write."""
    weight[1] = 1.0
    return weight


# fault: [(checkpoint key, change of the whole stored tensor)]
FAULTS: dict[str, list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]] = {
    "two hidden channels of layer 1's attention output exchanged": [
        ("decoder.layers.self_attention.linear_proj.weight", lambda w: exchanged(w, (1, 3), (1, 40)))],
    "layer 1's query norm weight dropped": [("decoder.layers.self_attention.q_layernorm.weight", dropped)],
    "layer 0's rope layout interleaved": [
        (QKV, interleaved_rope_rows),
        ("decoder.layers.self_attention.q_layernorm.weight", interleaved_norm),
        ("decoder.layers.self_attention.k_layernorm.weight", interleaved_norm)],
    "experts 2 and 5 of layer 1 exchanged": [
        (f"decoder.layers.mlp.experts.experts.linear_fc{n}.weight", lambda w: exchanged(w, (1, 2), (1, 5))) for n in (1, 2)],
    "query heads 0 and 1 of layer 1's first group exchanged": [
        (QKV, lambda w: exchanged(w, (1, slice(0, HEAD_DIM)), (1, slice(HEAD_DIM, 2 * HEAD_DIM))))],
}


def rewrite(ckpt: Path, key: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Write `change(stored tensor)` over the stored bytes of `key`, chunk by chunk, in place."""
    dcp = DCPCheckpoint(iteration_dir(ckpt))
    shape = dcp.shapes[key]
    before = as_torch(dcp.read_region(key, (0,) * len(shape), shape)).clone()
    after = change(before.clone())
    assert not torch.equal(after, before), key
    for chunk in dcp.metadata.state_dict_metadata[key].chunks:
        path, position = dcp.byte_span(key, tuple(chunk.offsets), tuple(chunk.sizes))
        region = after[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))].contiguous()
        with open(path, "r+b") as f:
            f.seek(position)
            f.write(region.view(-1).view(torch.uint8).numpy().tobytes())
    reread = DCPCheckpoint(iteration_dir(ckpt))
    assert torch.equal(as_torch(reread.read_region(key, (0,) * len(shape), shape)), after), key


def excess(report) -> float:
    """How many times its limit the KL of the report's worst prompt is."""
    return max(prompt.kl / limits.max_kl for prompt, limits in zip(report.prompts, report.thresholds))


def each_checkpoint_in_each_dtype(ckpts: dict[str, str], prompts: list[torch.Tensor], vocab_size: int):
    """In the rank: verify's own load and forward of every checkpoint, in fp32 and in bf16."""
    pipeline = Parallelism().pipeline.args(1)
    return {
        (name, dtype): megatron_outputs(ckpt, prompts, vocab_size, DTYPES[dtype], "cpu", "local", pipeline)
        for name, ckpt in ckpts.items()
        for dtype in DTYPES
    }


@pytest.fixture(scope="module")
def model(hf_model_factory, tmp_path_factory):
    """The HF model and its faithful conversion."""
    hf = hf_model_factory("qwen3-30b-a3b", weight_std=0.1)
    ckpt = tmp_path_factory.mktemp("verify_faults") / "faithful"
    convert_hf_to_mcore(hf, ckpt, parallelism=Parallelism())
    return hf, ckpt


def test_each_subtle_fault_fails_verify_in_fp32_and_in_bf16(model, tmp_path):
    hf, faithful = model
    ckpts = {"faithful": str(faithful)}
    for number, (fault, changes) in enumerate(FAULTS.items()):
        ckpts[fault] = str(tmp_path / f"fault{number}")
        shutil.copytree(faithful, ckpts[fault])
        for key, change in changes:
            rewrite(Path(ckpts[fault]), key, change)
    prompts = builtin_prompts(1000)
    reference, hf_bf16 = hf_outputs(hf, prompts, torch.float32, "cpu"), hf_outputs(hf, prompts, torch.bfloat16, "cpu")
    outputs = run_ranks(each_checkpoint_in_each_dtype, ckpts, prompts, 1000)
    reports = {
        (name, dtype): compare(reference, hf_bf16 if dtype == "bf16" else None, outputs[name, dtype], dtype, {}, "local", [])
        for name in ckpts
        for dtype in DTYPES
    }
    for (name, dtype), report in reports.items():
        print(f"\n{name}, {dtype} (KL {excess(report):.3g} times its limit on the worst prompt):\n{report.table()}")
    assert reports["faithful", "fp32"].passed and reports["faithful", "bf16"].passed
    assert not [key for key, report in reports.items() if key[0] != "faithful" and report.passed]
    # Not by a hair: each fault's worst prompt is ten times over its KL limit, in bf16 too (measured: 52 to 1500 times
    # in bf16, 1600 to 21000 in fp32; the faithful checkpoint 0.2 times in bf16). One prompt alone may miss a fault in
    # bf16: the experts exchanged pass the 64-token one, whose limit HF's own bf16 routing flips make wide.
    assert all(excess(report) > 10 for key, report in reports.items() if key[0] != "faithful")


def test_the_cli_fails_a_fault_in_bf16(model, tmp_path, capsys):
    """The same through `mconvert verify` itself, for the fault bf16 sees least (the smallest excess above)."""
    hf, faithful = model
    shutil.copytree(faithful, tmp_path / "fault")
    for key, change in FAULTS["experts 2 and 5 of layer 1 exchanged"]:
        rewrite(tmp_path / "fault", key, change)
    code = main(["verify", "--hf", str(hf), "--mcore", str(tmp_path / "fault"), "--device", "cpu", "--dtype", "bf16"])
    out = capsys.readouterr().out
    assert code == 1 and out.strip().endswith("FAIL"), out
