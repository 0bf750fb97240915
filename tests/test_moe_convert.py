"""MoE HF -> torch_dist without megatron-core: both HF expert layouts, per-expert chunks, and bad input
through the command line (one-line error, exit 1, nothing written)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from test_bad_input import assert_failed_cleanly, convert
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mconvert.cli import main
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

MODELS = {
    "qwen3_moe": ("qwen3-30b-a3b", dict(layers=4, mlp_only_layers=[0, 3])),
    "qwen2_moe": ("qwen1.5-moe-a2.7b", dict(layers=2)),
    "mixtral": ("mixtral-8x7b-v0.1", dict(layers=2)),
    "olmoe": ("olmoe-1b-7b-0924", dict(layers=2)),
    # transformers v5 names Hy3's router, expert bias and shared MLP otherwise beside its fused experts.
    "hy_v3": ("hy3-preview", dict(layers=2)),
}


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """family -> (per-expert, fused) HF checkpoints of the same random model."""
    made = {}

    def make(family):
        if family not in made:
            name, overrides = MODELS[family]
            config = shrink(real_config(name), **overrides)
            root = tmp_path_factory.mktemp(family)
            made[family] = tuple(
                make_hf_checkpoint(config, root / layout, fused_experts=layout == "fused") for layout in ("hub", "fused")
            )
        return made[family]

    return make


def stored(checkpoint_dir):
    """Every tensor of a torch_dist checkpoint and the chunks it is stored in."""
    reader = dcp.FileSystemReader(str(checkpoint_dir / "release"))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    chunks = {key: [(tuple(c.offsets), tuple(c.sizes)) for c in metadata[key].chunks] for key in tensors}
    return tensors, chunks


@pytest.mark.parametrize("family", sorted(MODELS))
def test_fused_and_per_expert_layouts_convert_alike(family, hf_pair, tmp_path):
    hub, fused = hf_pair(family)
    assert any("experts.0." in name for name in load_file(hub / "model.safetensors"))
    assert any(name.endswith("experts.gate_up_proj") for name in load_file(fused / "model.safetensors"))
    outs = []
    for layout, hf in (("hub", hub), ("fused", fused)):
        out = tmp_path / layout
        assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(out), "--ep", "2"]) == 0
        outs.append(stored(out)[0])
    assert outs[0].keys() == outs[1].keys()
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key


def test_expert_tensors_from_the_hf_experts(hf_pair, tmp_path):
    """Independently of the mapping tables: expert e's fc1 is [gate_e; up_e], fc2 is down_e, per layer."""
    hub, _ = hf_pair("qwen2_moe")
    out = tmp_path / "out"
    assert main(["hf-to-mcore", "--load-dir", str(hub), "--save-dir", str(out), "--tp", "2", "--etp", "2"]) == 0
    tensors, _ = stored(out)
    hf = load_file(hub / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}.mlp."
        for e in range(8):
            fc1 = tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"][layer, e]
            assert torch.equal(fc1, torch.cat([hf[f"{p}experts.{e}.gate_proj.weight"], hf[f"{p}experts.{e}.up_proj.weight"]]))
            fc2 = tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"][layer, e]
            assert torch.equal(fc2, hf[f"{p}experts.{e}.down_proj.weight"])
        assert torch.equal(tensors["decoder.layers.mlp.router.weight"][layer], hf[f"{p}gate.weight"])
        assert torch.equal(tensors["decoder.layers.mlp.shared_experts.gate_weight"][layer], hf[f"{p}shared_expert_gate.weight"])
        norm = hf[f"model.layers.{layer}.post_attention_layernorm.weight"]
        assert torch.equal(tensors["decoder.layers.pre_mlp_layernorm.weight"][layer], norm)
        assert torch.equal(tensors["decoder.layers.mlp.linear_fc1.layer_norm_weight"][layer], norm)


@pytest.mark.parametrize("etp", [1, 2])
def test_chunks_hold_one_expert_and_one_expert_tp_slice(hf_pair, tmp_path, etp):
    """So that an EP (and ETP) rank reads only its own experts' bytes."""
    hub, _ = hf_pair("qwen3_moe")
    out = tmp_path / "out"
    assert main(["hf-to-mcore", "--load-dir", str(hub), "--save-dir", str(out), "--ep", "4", "--etp", str(etp)]) == 0
    tensors, chunks = stored(out)
    # Layers 1 and 2 have experts, 0 and 3 are dense: one key per layer.
    assert "decoder.layers.0.mlp.linear_fc1.weight" in tensors and "decoder.layers.1.mlp.linear_fc1.weight" not in tensors
    fc1, fc2 = (f"decoder.layers.1.mlp.experts.experts.linear_fc{i}.weight" for i in (1, 2))
    assert tensors[fc1].shape == (8, 64, 64) and tensors[fc2].shape == (8, 64, 32)
    assert sorted(chunks[fc1]) == sorted(
        ((e, r * 64 // (2 * etp), 0), (1, 64 // (2 * etp), 64)) for e in range(8) for r in range(2 * etp)
    )
    assert sorted(chunks[fc2]) == sorted(((e, 0, r * 32 // etp), (1, 64, 32 // etp)) for e in range(8) for r in range(etp))
    assert tensors["decoder.layers.1.pre_mlp_layernorm.weight"].shape == (64,)


# ---- bad input: one-line error, exit 1, nothing written ----


@pytest.fixture
def broken(hf_pair, tmp_path):
    """A private copy of a tiny MoE checkpoint (family, layout), for a test to break."""

    def copy(family, layout="hub"):
        source = hf_pair(family)[layout == "fused"]
        target = tmp_path / f"hf-{family}-{layout}"
        shutil.copytree(source, target)
        return target

    return copy


def edit_config(hf, change):
    config = json.loads((hf / "config.json").read_text())
    change(config)
    (hf / "config.json").write_text(json.dumps(config))


def edit_weights(hf, change):
    tensors = load_file(hf / "model.safetensors")
    change(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--ep", "3"], "--ep 3 does not divide the number of experts (8)"),
        (["--etp", "3"], "--etp 3"),
        (["--ep", "16"], "--ep 16"),
    ],
)
def test_bad_expert_parallel_sizes(broken, tmp_path, capsys, flags, named):
    out = tmp_path / "out"
    assert_failed_cleanly(*convert(capsys, broken("mixtral"), out, *flags), out, named)


def test_missing_expert(broken, tmp_path, capsys):
    hf = broken("qwen2_moe")
    edit_weights(hf, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.mlp.experts.5.")])
    out = tmp_path / "out"
    assert_failed_cleanly(*convert(capsys, hf, out), out, "model.layers.1.mlp.experts.5.")


def test_more_experts_than_config_says(broken, tmp_path, capsys):
    hf = broken("mixtral")
    edit_config(hf, lambda c: c.update(num_local_experts=4))
    routers = [f"model.layers.{layer}.block_sparse_moe.gate.weight" for layer in range(2)]
    edit_weights(hf, lambda t: t.update({name: t[name][:4].clone() for name in routers}))
    out = tmp_path / "out"
    assert_failed_cleanly(*convert(capsys, hf, out, "--ep", "2"), out, "block_sparse_moe.experts.", "not used")


def test_fused_tensor_with_other_expert_count(broken, tmp_path, capsys):
    hf = broken("qwen3_moe", "fused")
    fused = [f"model.layers.1.mlp.experts.{name}" for name in ("gate_up_proj", "down_proj")]
    edit_weights(hf, lambda t: t.update({name: t[name][:4].clone() for name in fused}))
    out = tmp_path / "out"
    assert_failed_cleanly(*convert(capsys, hf, out), out, "model.layers.1.mlp.experts.gate_up_proj", "implies 8 experts")


@pytest.mark.parametrize(
    "family, field", [("qwen3_moe", "moe_intermediate_size"), ("qwen2_moe", "shared_expert_intermediate_size"), ("mixtral", "num_experts_per_tok")]
)
def test_moe_config_missing_a_field(broken, tmp_path, capsys, family, field):
    hf = broken(family)
    edit_config(hf, lambda c: c.pop(field))
    out = tmp_path / "out"
    assert_failed_cleanly(*convert(capsys, hf, out), out, field, "config.json")


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_megatron_flags_describe_the_moe(impl):
    import ast
    import re

    from mconvert.mappings import get_mapping
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.megatron_lm.args import megatron_args
    from mconvert.megatron_lm.flags import megatron_flags

    spec = get_mapping(shrink(real_config("qwen1.5-moe-a2.7b"), layers=4, decoder_sparse_step=2))[1]
    flags = megatron_flags(megatron_args(spec, Parallelism(tp=2, ep=4, etp=1), torch.bfloat16, impl))
    for flag in (
        "--num-experts 8",
        "--moe-router-topk 2",
        "--moe-ffn-hidden-size 32",
        "--moe-shared-expert-intermediate-size 96",
        "--moe-shared-expert-gate",
        "--moe-router-pre-softmax",
        "--expert-model-parallel-size 4",
        "--expert-tensor-parallel-size 1",
        "--add-qkv-bias",
    ):
        assert flag in flags
    assert ("--moe-grouped-gemm" in flags) == (impl == "transformer_engine")
    (freq,) = [flag for flag in flags if flag.startswith("--moe-layer-freq")]
    pattern = freq.split(" ", 1)[1].strip("'")
    # Megatron-LM's moe_freq_type evaluates the pattern after rejecting anything but digits and ,[]()+*
    assert not re.search(r"[^,\d\[\]\(\)\+\*]", pattern)
    assert ast.literal_eval(pattern) == [0, 1, 0, 1]

    mixtral = get_mapping(shrink(real_config("mixtral-8x7b-v0.1")))[1]
    flags = megatron_flags(megatron_args(mixtral, Parallelism(ep=2), torch.bfloat16, impl))
    assert "--moe-router-pre-softmax" not in flags and "--moe-ffn-hidden-size 128" in flags
    assert not any(flag.startswith(("--moe-layer-freq", "--moe-shared-expert")) for flag in flags)
