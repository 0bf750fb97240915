"""Peers' save folders for the tests of mcore-to-hf's reading of them (tests/test_tool_saves.py), each laid out as
the tool's own save code lays it out (read, not run here: tests/fixtures/tool_saves/MADE.md says which code), from a
torch_dist checkpoint mconvert's hf-to-mcore wrote (megatron-core's own keys) and the HF checkpoint it came from."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from mconvert.converters.bridge_saves import BLOCK_NAMES, TOWER_NAMES
from mconvert.dtypes import as_torch
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.mcore.layout import OPTIMIZER_KEY

VISION = "model.visual."


def hf_tensors(hf_dir: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)})  # noqa: SIM118 (safe_open is no dict)
    return tensors


def model_tensors(mcore_dir: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist save, whole."""
    checkpoint = DCPCheckpoint(iteration_dir(Path(mcore_dir)))
    return {
        key: as_torch(np.ascontiguousarray(checkpoint.read_region(key, (0,) * len(shape), tuple(shape)))).clone()
        for key, shape in checkpoint.shapes.items() if not OPTIMIZER_KEY.match(key)
    }


def interleave_qkv(hf: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's [q; k; v] of all heads as Megatron-Bridge's ConcatenatedQKVMapping stores them: per head [q; k; v]."""
    return hf.reshape(3, heads, -1, *hf.shape[1:]).transpose(0, 1).reshape(hf.shape).contiguous()


def write_torch_dist(tensors: dict[str, torch.Tensor], directory: Path, tracker: str | None = "release") -> Path:
    """`tensors` saved as megatron-core's dist_checkpointing saves them (torch DCP, metadata.json), one process."""
    directory.mkdir(parents=True)
    dcp.save(tensors, checkpoint_id=str(directory), no_dist=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    if tracker is not None:
        (directory.parent / "latest_checkpointed_iteration.txt").write_text(tracker)
    return directory


def bridge_vision_language_save(hf_dir: Path, mcore_dir: Path, out: Path, iteration: int = 5, hf_model_id: str | None = "hf",
                                vision_stacked: bool = False, qkv: bool = True) -> Path:
    """Megatron-Bridge 0.6.2's save of its Qwen3.5 vision-language model: the language model under `language_model.`,
    the vision tower under `vision_model.` in its bridge's names (each block's QKV interleaved per head unless `qkv` is
    False, blocks keyed one by one as its heterogeneous checkpoints are, or stacked), `iter_<N>/run_config.yaml`
    naming the HF model (`model.hf_model_id`; a path relative to `out` is made absolute)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    heads = config["vision_config"]["num_heads"]
    tensors = {"language_model." + key: tensor for key, tensor in model_tensors(mcore_dir).items()}
    hf_names_of_blocks = {hf: mb for mb, hf in BLOCK_NAMES.items()}
    hf_names_of_tower = {hf: mb for mb, hf in TOWER_NAMES.items()}
    blocks: dict[str, list[torch.Tensor]] = {}
    for name, tensor in sorted(hf_tensors(hf_dir, VISION).items(), key=lambda item: item[0]):
        local = name.removeprefix(VISION)
        if local in hf_names_of_tower:
            tensors["vision_model." + hf_names_of_tower[local]] = tensor
            continue
        _, block, rest = local.split(".", 2)
        mb = hf_names_of_blocks[rest]
        if qkv and mb.startswith("self_attention.linear_qkv.") and "layer_norm" not in mb:
            tensor = interleave_qkv(tensor, heads)
        if vision_stacked:
            blocks.setdefault(mb, []).append((int(block), tensor))
        else:
            tensors[f"vision_model.decoder.layers.{block}.{mb}"] = tensor
    for mb, stacked in blocks.items():
        tensors[f"vision_model.decoder.layers.{mb}"] = torch.stack([tensor for _, tensor in sorted(stacked, key=lambda item: item[0])])
    directory = write_torch_dist(tensors, out / f"iter_{iteration:07d}", tracker=str(iteration))
    model = {"_target_": "megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VLModelProvider", "num_layers": config["text_config"]["num_hidden_layers"]}
    if hf_model_id is not None:
        model["hf_model_id"] = str(out / hf_model_id) if not Path(hf_model_id).is_absolute() else hf_model_id
    (directory / "run_config.yaml").write_text(_yaml({"model": model, "checkpoint": {"save": str(out)}}))
    return out


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data)


def copy_hf_config(hf_dir: Path, into: Path) -> Path:
    """An HF folder with the config and tokenizer files alone (verl's `huggingface/`)."""
    into.mkdir(parents=True)
    for path in Path(hf_dir).iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json" and path.is_file():
            shutil.copy2(path, into / path.name)
    return into


def without_args(mcore_dir: Path) -> None:
    """A Megatron-LM save without the args that describe the model (common.pt removed)."""
    (iteration_dir(Path(mcore_dir)) / "common.pt").unlink()


def with_args(mcore_dir: Path, **fields) -> None:
    """The save's stored args with `fields` set (slime's hf_checkpoint)."""
    path = iteration_dir(Path(mcore_dir)) / "common.pt"
    common = torch.load(path, weights_only=False)
    args = common.get("args") or argparse.Namespace()
    for name, value in fields.items():
        setattr(args, name, value)
    common["args"] = args
    torch.save(common, path)


def swift_layers(text: dict, hf: dict[str, torch.Tensor], mcore: dict[str, torch.Tensor], layers: str) -> dict[str, torch.Tensor]:
    """mconvert's megatron-core tensors with each layer's attention as mcore-bridge 1.6.5's bridge makes it from the
    HF tensors (under `layers`, config `text`; gpt_bridge.py `_set_linear_in_proj`, `_set_linear_attn_state`,
    `_set_qkv`, qwen3_next_gdn.py's `_set_linear_in_proj` for Qwen3-Next): each delta-net layer's in_proj per key head
    [q; k; v; z; b; a] and conv1d [q; k; v] under one key, its output norm HF's w, the gated linear_qkv per query group
    [q_proj's rows; k; v]; the MoE post-attention norm under the Transformer Engine spec's name alone."""
    heads, groups = text["linear_num_key_heads"], text["num_key_value_heads"]
    key_dim, value_dim = text["linear_key_head_dim"] * heads, text["linear_value_head_dim"] * text["linear_num_value_heads"]
    tensors = {}
    for key, tensor in mcore.items():
        local = key.split(".", 3)[3] if key.startswith("decoder.layers.") else ""
        if local.startswith(("self_attention.in_proj.weight.", "self_attention.conv1d.weight.", "self_attention.out_norm.", "self_attention.linear_qkv.weight")):
            continue
        if local == "mlp.linear_fc1.layer_norm_weight" and key.replace(local, "pre_mlp_layernorm.weight") in mcore:
            continue
        tensors[key] = tensor

    def per_head(*parts: torch.Tensor) -> torch.Tensor:  # each key head's rows of every part, head after head
        return torch.cat([x.reshape(heads, -1, *x.shape[1:]) for x in parts], 1).reshape(-1, *parts[0].shape[1:])

    for layer in range(text["num_hidden_layers"]):
        at, of = f"decoder.layers.{layer}.self_attention.", f"{layers}{layer}."
        if of + "linear_attn.conv1d.weight" in hf:
            if of + "linear_attn.in_proj_qkvz.weight" in hf:  # Qwen3-Next: HF's rows already per key head
                tensors[at + "in_proj.weight"] = per_head(*(hf[of + f"linear_attn.{name}.weight"] for name in ("in_proj_qkvz", "in_proj_ba")))
            else:  # Qwen3.5: in_proj_qkv flat [q; k; v] of all heads
                q, k, v = torch.split(hf[of + "linear_attn.in_proj_qkv.weight"], [key_dim, key_dim, value_dim])
                tensors[at + "in_proj.weight"] = per_head(q, k, v, *(hf[of + f"linear_attn.in_proj_{name}.weight"] for name in "zba"))
            tensors[at + "conv1d.weight"] = per_head(*torch.split(hf[of + "linear_attn.conv1d.weight"], [key_dim, key_dim, value_dim]))
            tensors[at + "out_norm.weight"] = hf[of + "linear_attn.norm.weight"]
        else:
            q, k, v = (hf[of + f"self_attn.{name}_proj.weight"] for name in "qkv")
            tensors[at + "linear_qkv.weight"] = torch.cat([x.reshape(groups, -1, x.shape[-1]) for x in (q, k, v)], 1).reshape(-1, q.shape[-1])
    return tensors


def swift_save(tensors: dict[str, torch.Tensor], hf_dir: Path, out: Path, iteration: int, tp: int) -> Path:
    """ms-swift's save folder: no args describing the model in the save, `args.json` beside naming the HF model and
    the TP size."""
    write_torch_dist(tensors, out / f"iter_{iteration:07d}", tracker=str(iteration))
    (out / "args.json").write_text(json.dumps({"model": str(hf_dir), "tensor_model_parallel_size": tp, "save": str(out)}))
    return out


def swift_qwen3_next_save(hf_dir: Path, mcore_dir: Path, out: Path, iteration: int = 2, tp: int = 2) -> Path:
    """ms-swift 4.6.0's save of Qwen3-Next under mcore-bridge 1.6.5's default GatedDeltaNet and GatedSelfAttention
    (swift_layers); the rest as megatron-core's (mconvert's save)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    tensors = swift_layers(config, hf_tensors(hf_dir, "model.layers."), model_tensors(mcore_dir), "model.layers.")
    return swift_save(tensors, hf_dir, out, iteration, tp)


def swift_qwen3_5_save(hf_dir: Path, mcore_dir: Path, out: Path, iteration: int = 2, tp: int = 2, vision: bool = True) -> Path:
    """ms-swift 4.6.0's save of Qwen3.5's image-text model, mcore-bridge 1.6.5's MultimodalGPTModel: the language
    model's megatron-core keys under `language_model.` with its layers as swift_layers makes them, and, unless its
    run is `language_model_only` (`vision` False), transformers' vision tower under `visual.visual.` in HF's names
    (Qwen3_5Vit, `model.visual` -> `visual`), as HF holds it."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    layers = "model.language_model.layers."
    language = swift_layers(config["text_config"], hf_tensors(hf_dir, layers), model_tensors(mcore_dir), layers)
    tensors = {"language_model." + key: tensor for key, tensor in language.items()}
    if vision:
        tensors.update({"visual.visual." + name.removeprefix(VISION): tensor for name, tensor in hf_tensors(hf_dir, VISION).items()})
    return swift_save(tensors, hf_dir, out, iteration, tp)
