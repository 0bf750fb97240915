"""Random-init HF checkpoints at a real model's full size, written tensor by tensor without ever building the
model: for the benchmarks (`python -m mconvert.synthetic --full-size`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mconvert.converters.quantized_export import is_fp8_on_the_hub
from mconvert.formats.quantized import MXFP4_BLOCKS, MXFP4_SCALES

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3", "uint8": "U8"}
# Elements generated at a time while writing a random tensor: bounds memory for the largest embeddings.
RANDOM_BLOCK = 1 << 24


def as_transformers_builds(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as transformers' own class builds it: a checkpoint that ships its own code (auto_map) under a
    model_type transformers does not know, as the class its `architectures` names (mconvert reads it so)."""
    from mconvert.mappings import remote_code_architecture

    taken = remote_code_architecture(config)
    if taken is None:
        return config
    return {**{k: v for k, v in config.items() if k != "auto_map"}, "model_type": taken[0].hf_model_type(config)}


def keep_remote_code_identity(config: dict[str, Any], out_dir: Path) -> None:
    """config.json as such a checkpoint has it: its own model_type, architectures and auto_map."""
    if as_transformers_builds(config) is config:
        return
    written = json.loads((out_dir / "config.json").read_text())
    identity = {key: config[key] for key in ("model_type", "architectures", "auto_map")}
    (out_dir / "config.json").write_text(json.dumps({**written, **identity}, indent=2) + "\n")


def _shards(parameters: list[tuple[str, Any]], max_shard_bytes: int) -> list[list[tuple[str, Any]]]:
    """Split parameters, in model order, into consecutive groups of at most `max_shard_bytes`, as
    transformers' save_pretrained shards them (a tensor larger than that gets a shard of its own)."""
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, parameter in parameters:
        nbytes = parameter.numel() * parameter.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, parameter))
        size += nbytes
    return shards


def _mxfp4_blocks(parameters: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """gpt-oss's hub layout: each layer's fused experts (transformers' [E, in, out]) as MXFP4, `_blocks` [E, out,
    in / 32, 16] bytes of two 4-bit values and `_scales` [E, out, in / 32] exponents; the rest as it is."""
    import torch

    out = []
    for name, parameter in parameters:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.append((name, parameter))
            continue
        experts, inputs, outputs = parameter.shape
        out += [
            (name + MXFP4_BLOCKS, torch.empty((experts, outputs, inputs // 32, 16), dtype=torch.uint8, device="meta")),
            (name + MXFP4_SCALES, torch.empty((experts, outputs, inputs // 32), dtype=torch.uint8, device="meta")),
        ]
    return out


def _write_random_safetensors(path: Path, parameters: list[tuple[str, Any]], generator) -> None:
    """One safetensors file of random tensors, generated and written a block at a time."""
    import torch

    parameters = sorted(parameters, key=lambda item: item[0])  # safetensors stores tensors by name
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, parameter in parameters:
        nbytes = parameter.numel() * parameter.element_size()
        dtype = SAFETENSORS_DTYPES[str(parameter.dtype).removeprefix("torch.")]
        header[name] = {"dtype": dtype, "shape": list(parameter.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    block = torch.empty(RANDOM_BLOCK, device=generator.device)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name, parameter in parameters:
            matrix = parameter.dim() > 1
            remaining = parameter.numel()
            while remaining:
                values = block[: min(remaining, RANDOM_BLOCK)]
                if parameter.dtype == torch.uint8:  # MXFP4: any bytes of values; exponents near 2^0
                    values.uniform_(*((120, 128) if name.endswith(MXFP4_SCALES) else (0, 256)), generator=generator).floor_()
                else:
                    # Norm weights of ones and zero biases would hide mistakes in their mapping.
                    values.normal_(0.0, 0.05 if matrix else 0.5, generator=generator)
                    if not matrix:
                        values.add_(1.0)
                f.write(values.to(parameter.dtype).cpu().view(torch.uint8).numpy().data)
                remaining -= len(values)


def _fp8_blocks(parameters: list[tuple[str, Any]], block: tuple[int, int]) -> list[tuple[str, Any]]:
    """The hub's FP8 layout: each quantized weight in float8_e4m3fn, followed by its `_scale_inv`, one fp32
    factor per block (partial blocks at the edges count)."""
    import torch

    out = []
    for name, parameter in parameters:
        if not is_fp8_on_the_hub(name):
            out.append((name, parameter))
            continue
        rows, cols = parameter.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        out += [
            (name, torch.empty(parameter.shape, dtype=torch.float8_e4m3fn, device="meta")),
            (name + "_scale_inv", torch.empty(grid, dtype=torch.float32, device="meta")),
        ]
    return out


def _per_expert(parameters: list[tuple[str, Any]], config: dict[str, Any]) -> list[tuple[str, Any]]:
    """The hub's layout of MoE experts, one tensor per expert, in place of the fused 3-D tensors transformers
    holds in memory; the family's table says how the two layouts correspond."""
    import torch

    from mconvert.mappings import get_mapping

    family, spec = get_mapping(config)
    table, fused = family.table, dict(parameters)
    if not table.experts or table.hub_experts_fused:
        return parameters  # the hub stores this family's experts fused too (gpt-oss, Qwen3.5-MoE)
    replaced: dict[str, list[tuple[str, Any]]] = {}
    for layer in range(spec.num_layers):
        prefix = table.layer_prefix.format(layer=layer)
        for entry in table.fused_experts:
            (source,) = entry.hf_names
            name = prefix + source.split("[")[0]
            if name not in fused:
                continue  # a dense layer
            per_expert = next(e for e in table.experts if e.mcore == entry.mcore)
            experts, *shape = fused[name].shape
            replaced[name] = [
                (prefix + hf_name.format(expert=expert), torch.empty(hf_shape, dtype=fused[name].dtype, device="meta"))
                for expert in range(experts)
                for hf_name, hf_shape in zip(per_expert.hf_names, per_expert.hf_shapes(tuple(shape), spec))
            ]
        # Modules of the MoE block that the fused layout names differently (Mixtral's router).
        for entry in table.fused_moe_mlp or ():
            hub = next(e for e in table.moe_mlp if e.mcore == entry.mcore)
            for fused_name, hub_name in zip(entry.hf_names, hub.hf_names):
                if prefix + fused_name in fused:
                    replaced[prefix + fused_name] = [(prefix + hub_name, fused[prefix + fused_name])]
    return [item for name, p in parameters for item in replaced.get(name, [(name, p)])]


def write_random_hf_checkpoint(
    config: dict[str, Any],
    out_dir: str | os.PathLike,
    seed: int = 0,
    max_shard_bytes: int = 5 * 10**9,
    device: str = "cpu",
    fused_experts: bool = False,
    quantized: bool = False,
) -> Path:
    """A random-init checkpoint of `config` at full size, written tensor by tensor without ever building the
    model: names, shapes and dtypes come from transformers' model built on the meta device, the files are
    sharded as the hub's are (`max_shard_bytes` each, with an index when there are several). MoE experts are
    stored one tensor per expert as on the hub, or fused in 3-D tensors with `fused_experts`. With `quantized`, the
    weights the hub quantizes are stored as the config's quantization_config says, which config.json keeps: random
    FP8 values with random block scales (DeepSeek-V3's fp8), or random MXFP4 blocks and exponents (gpt-oss's
    mxfp4); otherwise everything is unquantized and config.json has no quantization_config."""
    import torch
    import transformers

    quantization = config.get("quantization_config") if quantized else None
    mxfp4 = quantization is not None and quantization.get("quant_method") == "mxfp4"
    block = tuple(quantization["weight_block_size"]) if quantization is not None and not mxfp4 else None
    # transformers' model is built unquantized (a quantization_config would have it quantize the model).
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = transformers.AutoConfig.for_model(**as_transformers_builds(config))
    # An image-text config names its dtype in its text_config.
    dtype = getattr(torch, config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype") or "float32")
    with torch.device("meta"):
        # An image-text checkpoint (text_config beside vision_config) is made whole, vision tower included.
        auto = transformers.AutoModelForImageTextToText if "text_config" in config else transformers.AutoModelForCausalLM
        model = auto.from_config(hf_config, dtype=dtype)
    # named_parameters() lists a tied output layer once, under the embedding's name, as save_pretrained stores it.
    # Persistent buffers (a router's expert bias) are stored too.
    stored = model.state_dict()
    # The hub stores every weight in the model's dtype, though transformers 5.24 holds a router's gate in fp32; a
    # stored buffer (a router's expert bias) keeps the dtype it has.
    parameters = [(n, p.to(dtype)) for n, p in model.named_parameters()]
    parameters += [(n, b) for n, b in model.named_buffers() if n in stored]
    parameters = parameters if fused_experts else _per_expert(parameters, config)
    if block:
        parameters = _fp8_blocks(parameters, block)
    elif mxfp4:
        parameters = _mxfp4_blocks(parameters)
    shards = _shards(parameters, max_shard_bytes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    keep_remote_code_identity(config, out_dir)
    if quantization is not None:
        written = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**written, "quantization_config": quantization}, indent=2) + "\n")
    # On a GPU the random numbers of an 8B model take seconds instead of minutes.
    generator = torch.Generator(device=device).manual_seed(seed)
    if len(shards) == 1:
        _write_random_safetensors(out_dir / "model.safetensors", shards[0], generator)
        return out_dir
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_random_safetensors(out_dir / file, shard, generator)
        for name, parameter in shard:
            weight_map[name] = file
            total += parameter.numel() * parameter.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir
