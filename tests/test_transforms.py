"""The mapping transforms are exact inverses, and QKV interleaving matches Megatron's group-major layout."""

import pytest
import torch

from mconvert.mappings import get_mapping
from mconvert.mappings.splits import Column, GatedColumn, Replicated
from mconvert.mappings.transforms import Concat, QKVInterleave, Rename
from mconvert.synthetic import real_config, shrink


@pytest.fixture(scope="module")
def spec():
    return get_mapping(shrink(real_config("qwen3-8b")))[1]


def test_qkv_interleave_is_group_major(spec):
    # qwen3 shrunk: 4 query heads in 2 groups, head_dim 32.
    d, groups, per_group = spec.head_dim, spec.num_query_groups, spec.num_attention_heads // spec.num_query_groups
    q = torch.arange(spec.num_attention_heads * d).float().reshape(-1, 1)
    k = -torch.arange(groups * d).float().reshape(-1, 1) - 1
    v = torch.full((groups * d, 1), 1e6)
    fused = QKVInterleave("qkv", "q", "k", "v", split=Column(QKVInterleave.fused_rows)).to_mcore([q, k, v], spec)
    group_rows = (per_group + 2) * d
    for g in range(groups):
        block = fused[g * group_rows : (g + 1) * group_rows]
        assert torch.equal(block[: per_group * d], q[g * per_group * d : (g + 1) * per_group * d])
        assert torch.equal(block[per_group * d : (per_group + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(block[(per_group + 1) * d :], v[g * d : (g + 1) * d])


@pytest.mark.parametrize(
    "entry",
    [Rename("m", "h", split=Replicated(48)), Concat("fc1", ("gate", "up"), split=GatedColumn(128)),
     QKVInterleave("qkv", "q", "k", "v", split=Column(QKVInterleave.fused_rows))],
    ids=["rename", "concat", "qkv"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_round_trip_is_bit_exact(entry, bias, spec):
    rows = {"m": 48, "fc1": 256, "qkv": (spec.num_attention_heads + 2 * spec.num_query_groups) * spec.head_dim}[entry.mcore]
    shape = (rows,) if bias else (rows, spec.hidden_size)
    hf = [torch.randn(s, dtype=torch.bfloat16) for s in entry.hf_shapes(shape, spec)]
    mcore = entry.to_mcore(hf, spec)
    assert tuple(mcore.shape) == shape
    back = entry.to_hf(mcore, spec)
    assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(hf, back))
