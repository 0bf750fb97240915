"""A CLI conversion of a tiny checkpoint loads through torch's own DCP reader with the expected values."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mconvert import cli
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink


def load_converted(release) -> dict:
    """Every key of the checkpoint, read by torch.distributed.checkpoint into tensors of the stored shapes."""
    metadata = pickle.loads((release / ".metadata").read_bytes())
    state = {
        key: None if isinstance(meta, BytesStorageMetadata) else torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(release), no_dist=True)
    return state


def megatron_qkv(q, k, v, groups):
    """Megatron's fused QKV: per query group, its query heads, then its key head, then its value head."""
    parts = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_checkpoint_loads_with_expected_values(tmp_path, tp):
    config = shrink(real_config("qwen2.5-7b-instruct"))  # untied output layer, QKV biases, GQA
    hf_dir = make_hf_checkpoint(config, tmp_path / "hf", max_shard_size="200KB", dtype="bfloat16")
    out = tmp_path / "mcore"
    assert cli.main(["hf-to-mcore", "--load-dir", str(hf_dir), "--save-dir", str(out), "--tp", str(tp)]) == 0

    state = load_converted(out / "release")
    hf = {}
    for shard in hf_dir.glob("*.safetensors"):
        hf.update(load_file(shard))
    groups = config["num_key_value_heads"]

    def padded(tensor):
        rows = state["embedding.word_embeddings.weight"].shape[0]
        return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], tensor.shape[1])])

    expected = {
        "embedding.word_embeddings.weight": padded(hf["model.embed_tokens.weight"]),
        "output_layer.weight": padded(hf["lm_head.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": lambda p: hf[p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": lambda p: megatron_qkv(
            *(hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"), groups
        ),
        "self_attention.linear_qkv.bias": lambda p: megatron_qkv(*(hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"), groups),
        "self_attention.linear_proj.weight": lambda p: hf[p + "self_attn.o_proj.weight"],
        "mlp.linear_fc1.layer_norm_weight": lambda p: hf[p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": lambda p: torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]),
        "mlp.linear_fc2.weight": lambda p: hf[p + "mlp.down_proj.weight"],
    }
    for name, build in per_layer.items():
        expected[f"decoder.layers.{name}"] = torch.stack(
            [build(f"model.layers.{layer}.") for layer in range(config["num_hidden_layers"])]
        )

    tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    assert tensors.keys() == expected.keys()
    for key, value in expected.items():
        assert tensors[key].dtype == torch.bfloat16 and torch.equal(tensors[key], value), key
    extra_states = [value for key, value in state.items() if "_extra_state" in key]
    assert extra_states and all(len(value) == 1 and value[0].numel() == 0 for value in extra_states)


def test_tensors_wider_than_the_checkpoint_are_said_to_round(tmp_path, capsys):
    """transformers keeps DeepSeek-V3.2's indexer weights_proj in fp32 in a bf16 model (`_keep_in_fp32_modules`), so a
    checkpoint it saves holds them so. A bf16 conversion rounds them, as Megatron's bf16 parameters would: said, and
    the export gives their rounded values (the rest bit for bit, the routing bias that Megatron keeps in fp32 too);
    --dtype fp32 keeps them and says nothing."""
    from safetensors.torch import save_file

    hf_dir = make_hf_checkpoint(shrink(real_config("deepseek-v3.2"), layers=2), tmp_path / "hf", dtype="bfloat16")
    (stored,) = hf_dir.glob("*.safetensors")
    weights = load_file(stored)
    wide = [name for name in weights if name.endswith("indexer.weights_proj.weight")]
    for name in wide:
        weights[name] = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0)) * 0.1
    save_file(weights, stored, metadata={"format": "pt"})
    assert cli.main(["hf-to-mcore", "--load-dir", str(hf_dir), "--save-dir", str(tmp_path / "mc")]) == 0
    printed = capsys.readouterr().out
    assert f"note: {wide[0]} and 1 more are float32 in {hf_dir} and stored in bfloat16" in printed
    assert cli.main(["mcore-to-hf", "--load-dir", str(tmp_path / "mc"), "--save-dir", str(tmp_path / "back")]) == 0
    back = {k: v for path in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(path).items()}
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], v.to(torch.bfloat16) if k in wide else v) for k, v in weights.items())
    assert not all(torch.equal(back[k].float(), weights[k]) for k in wide)
    assert cli.main(["hf-to-mcore", "--load-dir", str(hf_dir), "--save-dir", str(tmp_path / "mc32"), "--dtype", "fp32"]) == 0
    assert "are float32 in" not in capsys.readouterr().out
