"""Random-init HF checkpoints from real configs, shrunk: the test models, the demo and the benchmarks.

There is no network: models are made from config.json files (the real ones ship in `mconvert/configs/`) by
transformers itself, so the checkpoint layout is exactly what transformers writes.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

# The real configs this package carries (mconvert/configs), by name.
CONFIGS = tuple(sorted(path.name.removesuffix(".json") for path in resources.files("mconvert").joinpath("configs").iterdir() if path.name.endswith(".json")))


def real_config(name: str) -> dict[str, Any]:
    """A real model's config.json, as published (see mconvert/configs/)."""
    return json.loads(resources.files("mconvert").joinpath("configs", f"{name}.json").read_text())


def model_config(model: str) -> dict[str, Any]:
    """A real config as the scripts name it: NAME[@LAYERS][+FIELD=VALUE...], the config of NAME (mconvert/configs)
    cut to its first LAYERS layers, with config fields set (VALUE read as JSON, else as a string). E.g.
    `deepseek-v3@2+first_k_dense_replace=1`: its first dense and first MoE layer at full width."""
    name, *fields = model.split("+")
    name, _, layers = name.partition("@")
    config = real_config(name)
    if layers:
        config["num_hidden_layers"] = int(layers)
        if config.get("layer_types"):
            config["layer_types"] = config["layer_types"][: int(layers)]
    for field in fields:
        key, _, value = field.partition("=")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value
    return config


def shrink(config: dict[str, Any], layers: int = 2, **overrides: Any) -> dict[str, Any]:
    """The same architecture at test size, keeping what distinguishes it: GQA or MHA, a head_dim that differs
    from hidden/heads, biases, rope settings, MoE with shared experts and dense layers mixed in."""
    small = dict(config)
    heads = 4
    grouped = config.get("num_key_value_heads", config["num_attention_heads"]) < config["num_attention_heads"]
    small.update(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=heads,
        num_key_value_heads=2 if grouped else heads,
        intermediate_size=128,
        vocab_size=1000,
        bos_token_id=1,
        eos_token_id=2,
    )
    if config.get("pad_token_id") is not None:
        small["pad_token_id"] = 0
    if "head_dim" in config and config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        small["head_dim"] = 32  # hidden/heads is 16: keeps the two different, as in Qwen3
    elif "head_dim" in config:
        small["head_dim"] = 16
    experts_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)
    if experts_key:
        small[experts_key] = 8
        small["num_experts_per_tok"] = 2
    if "moe_intermediate_size" in config:
        small["moe_intermediate_size"] = 32
    if config.get("shared_expert_intermediate_size"):
        small["shared_expert_intermediate_size"] = 96
    if config.get("first_k_dense_replace"):
        small["first_k_dense_replace"] = 1  # one dense layer, then experts
    if config.get("n_group", 1) > 1:
        small.update(n_group=4, topk_group=2, num_experts_per_tok=4)  # groups scored by their best 2, as the hub's
    if "kv_lora_rank" in config:
        # Multi-latent attention: ranks and head parts all distinct, so that a swapped one shows.
        small.update(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
        if config.get("q_lora_rank"):
            small["q_lora_rank"] = 40
    if config.get("layer_types"):
        # Per-layer kinds (gpt-oss's sliding and full attention) follow the layers, repeating their pattern.
        small["layer_types"] = [config["layer_types"][i % len(config["layer_types"])] for i in range(layers)]
    # The test weights are made in full precision; FP8 and MXFP4 checkpoints are made by quantizing them.
    small.pop("quantization_config", None)
    small.update(overrides)
    return small


def make_hf_checkpoint(
    config: dict[str, Any],
    out_dir: str | os.PathLike,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str = "float32",
    fused_experts: bool = False,
) -> Path:
    """A random-init model of `config` saved by transformers' `save_pretrained` (several shards when
    `max_shard_size` is small). MoE experts are saved one tensor per expert as on the hub, or with
    `fused_experts` in the layout transformers v5 holds in memory (3-D tensors of all experts)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**_as_transformers_builds(config))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():
        for parameter in model.parameters():
            # Norm weights of ones and zero biases would hide mistakes in their mapping.
            parameter.normal_(0.0, 0.05 if parameter.dim() > 1 else 0.5).add_(1.0 if parameter.dim() == 1 else 0.0)
            # The hub stores every weight in the model's dtype; transformers 5.24 holds a router's gate in fp32,
            # and save_pretrained would write it so.
            parameter.data = parameter.data.to(getattr(torch, dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A router's expert bias is zero at init: a dropped one would go unseen. Large enough to
                # change which experts are chosen. In fp32 whatever the weights' dtype, as the hub stores it.
                buffer.data = buffer.data.float().normal_(0.0, 0.1)
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, save_original_format=not fused_experts, **kwargs)
    _keep_remote_code_identity(config, out_dir)
    return out_dir


def _as_transformers_builds(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as transformers' own class builds it: a checkpoint that ships its own code (auto_map) under a
    model_type transformers does not know, as the class its `architectures` names (mconvert reads it so)."""
    from mconvert.mappings import remote_code_architecture

    taken = remote_code_architecture(config)
    if taken is None:
        return config
    return {**{k: v for k, v in config.items() if k != "auto_map"}, "model_type": taken[0].hf_model_type(config)}


def _keep_remote_code_identity(config: dict[str, Any], out_dir: Path) -> None:
    """config.json as such a checkpoint has it: its own model_type, architectures and auto_map."""
    if _as_transformers_builds(config) is config:
        return
    written = json.loads((out_dir / "config.json").read_text())
    identity = {key: config[key] for key in ("model_type", "architectures", "auto_map")}
    (out_dir / "config.json").write_text(json.dumps({**written, **identity}, indent=2) + "\n")


def add_mtp_layers(hf_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Give a checkpoint made by `make_hf_checkpoint` the multi-token prediction layers its config names
    (`num_nextn_predict_layers`), as the hub's DeepSeek-V3 and GLM-4.5 hold them and transformers never builds
    them: HF layer num_hidden_layers + m, with a decoder layer like the last one (random values), its own
    enorm, hnorm, eh_proj and shared_head.norm, and copies of the embedding and output head. Written to
    `mtp.safetensors` beside `model.safetensors`, with an index of both."""
    import torch
    from safetensors.torch import load_file, save_file

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    model = load_file(hf_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)

    def random_like(tensor):
        values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        return (values * 0.05 if tensor.dim() > 1 else values * 0.5 + 1.0).to(tensor.dtype)

    last = f"model.layers.{layers - 1}."
    mtp = {}
    for m in range(config.get("num_nextn_predict_layers") or 0):
        prefix = f"model.layers.{layers + m}."
        dtype = model["model.norm.weight"].dtype
        mtp.update({prefix + name[len(last) :]: random_like(t) for name, t in model.items() if name.startswith(last)})
        for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)), ("shared_head.norm.weight", (hidden,))):
            mtp[prefix + name] = random_like(torch.empty(shape, dtype=dtype))
        mtp[prefix + "embed_tokens.weight"] = model["model.embed_tokens.weight"].clone()
        mtp[prefix + "shared_head.head.weight"] = model["lm_head.weight"].clone()
    save_file(mtp, hf_dir / "mtp.safetensors", metadata={"format": "pt"})
    # Two files: an index says which holds what, as the hub's shards are listed.
    weight_map = {name: "model.safetensors" for name in model} | {name: "mtp.safetensors" for name in mtp}
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return hf_dir


SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
# Elements generated at a time while writing a random tensor: bounds memory for the largest embeddings.
RANDOM_BLOCK = 1 << 24


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens (`w0` ... and `[UNK]` last) in HF's files, made offline:
    what transformers' AutoTokenizer and Megatron-LM's HuggingFaceTokenizer load from a model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)


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
                # Norm weights of ones and zero biases would hide mistakes in their mapping.
                values.normal_(0.0, 0.05 if matrix else 0.5, generator=generator)
                if not matrix:
                    values.add_(1.0)
                f.write(values.to(parameter.dtype).cpu().view(torch.uint8).numpy().data)
                remaining -= len(values)


def is_fp8_on_the_hub(name: str) -> bool:
    """Which weights DeepSeek-V3's hub checkpoints store block-quantized in FP8: the linear layers of attention
    and MLPs (experts included); not embeddings, norms, routers or the output layer."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight"))


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
    if not table.experts:
        return parameters  # the hub stores this family's experts fused too (gpt-oss)
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
    fp8: bool = False,
) -> Path:
    """A random-init checkpoint of `config` at full size, written tensor by tensor without ever building the
    model: names, shapes and dtypes come from transformers' model built on the meta device, the files are
    sharded as the hub's are (`max_shard_bytes` each, with an index when there are several). MoE experts are
    stored one tensor per expert as on the hub, or fused in 3-D tensors with `fused_experts`. With `fp8`, the
    weights the hub quantizes are random FP8 values with random block scales, in the block size of the
    config's quantization_config, which config.json keeps; otherwise everything is unquantized and config.json
    has no quantization_config."""
    import torch
    import transformers

    quantization = config.get("quantization_config")
    block = tuple(quantization["weight_block_size"]) if fp8 and quantization else None
    # transformers' model is built unquantized (a quantization_config would have it quantize the model).
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = transformers.AutoConfig.for_model(**_as_transformers_builds(config))
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    # named_parameters() lists a tied output layer once, under the embedding's name, as save_pretrained stores it.
    # Persistent buffers (a router's expert bias) are stored too.
    stored = model.state_dict()
    # The hub stores every weight in the model's dtype, though transformers 5.24 holds a router's gate in fp32; a
    # stored buffer (a router's expert bias) keeps the dtype it has.
    parameters = [(n, p.to(dtype)) for n, p in model.named_parameters()]
    parameters += [(n, b) for n, b in model.named_buffers() if n in stored]
    parameters = parameters if fused_experts else _per_expert(parameters, config)
    shards = _shards(_fp8_blocks(parameters, block) if block else parameters, max_shard_bytes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out_dir)
    _keep_remote_code_identity(config, out_dir)
    if block:
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


def main(argv: list[str] | None = None) -> None:
    """python -m mconvert.synthetic --config qwen2.5-7b-instruct --out DIR: a shrunk random-init HF checkpoint
    (or, with --full-size, one of the real shape, written tensor by tensor)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mconvert.synthetic", description=main.__doc__)
    parser.add_argument("--config", required=True, choices=CONFIGS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=None, help="number of layers (shrunk: 2; full size: all)")
    parser.add_argument("--full-size", action="store_true", help="the real width, in bf16")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    config = real_config(options.config)
    if options.full_size:
        if options.layers:
            config["num_hidden_layers"] = options.layers
        write_random_hf_checkpoint(config, options.out, seed=options.seed)
    else:
        make_hf_checkpoint(shrink(config, layers=options.layers or 2), options.out, seed=options.seed)
    print(options.out)


if __name__ == "__main__":
    main()
