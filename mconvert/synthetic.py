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

from mconvert.full_size import as_transformers_builds, keep_remote_code_identity

# The real configs this package carries (mconvert/configs), by name.
CONFIGS = tuple(sorted(path.name.removesuffix(".json") for path in resources.files("mconvert").joinpath("configs").iterdir() if path.name.endswith(".json")))


def real_config(name: str) -> dict[str, Any]:
    """A real model's config.json, as published (see mconvert/configs/)."""
    return json.loads(resources.files("mconvert").joinpath("configs", f"{name}.json").read_text())


def model_config(model: str) -> dict[str, Any]:
    """A real config as the scripts name it: NAME[@LAYERS][+FIELD=VALUE...], the config of NAME (mconvert/configs)
    cut to its first LAYERS layers (an image-text model's language model), with config fields set (VALUE read as
    JSON, else as a string; FIELD dotted for a nested config's). E.g. `deepseek-v3@2+first_k_dense_replace=1`: its
    first dense and first MoE layer at full width; `qwen3.5-35b-a3b@4+text_config.num_experts=64`."""
    name, *fields = model.split("+")
    name, _, layers = name.partition("@")
    config = real_config(name)
    if layers:
        text = config.get("text_config") or config  # an image-text model's language model
        text["num_hidden_layers"] = int(layers)
        for per_layer in ("layer_types", "hybrid_override_pattern"):  # a list or a string, one entry a layer
            if text.get(per_layer):
                text[per_layer] = text[per_layer][: int(layers)]
    for field in fields:
        key, _, value = field.partition("=")
        *path, key = key.split(".")  # text_config.num_experts: a field of a nested config
        target = config
        for name in path:
            target = target[name]
        try:
            target[key] = json.loads(value)
        except json.JSONDecodeError:
            target[key] = value
    return config


def shrink(config: dict[str, Any], layers: int = 2, **overrides: Any) -> dict[str, Any]:
    """The same architecture at test size, keeping what distinguishes it: GQA or MHA, a head_dim that differs
    from hidden/heads, biases, rope settings, MoE with shared experts and dense layers mixed in."""
    if isinstance(config.get("text_config"), dict):  # image-text: the language model shrunk, a small vision tower
        text, vision = shrink(config["text_config"], layers, **overrides), config["vision_config"]
        if "vt_hidden_size" in vision:  # Kimi-K2.5's MoonViT and projector
            vision = dict(vision, vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=1,
                          init_pos_emb_height=4, init_pos_emb_width=4, mm_hidden_size=32, text_hidden_size=text["hidden_size"])
        elif vision.get("model_type") == "siglip_vision_model":  # Gemma 3's, its 16 patches a side pooled to 4
            vision = dict(vision, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=224)
            config = {**config, "mm_tokens_per_image": 16}
        else:
            vision = dict(vision, depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        return {**config, "text_config": text, "vision_config": vision}
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
    if "expert_hidden_dim" in config:  # Hy3's experts' width again, the name vLLM reads it by
        small["expert_hidden_dim"] = small.get("moe_intermediate_size", 32)
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
        if "qk_head_dim" in config:
            small["qk_head_dim"] = 24
    if "index_topk" in config:
        # Sparse attention's indexer: a rope part and a wider rest, heads enough that few scores are all-zero
        # after its ReLU, and a top-k well below the tests' prompts, so that it chooses.
        small.update(index_n_heads=8, index_head_dim=24, index_topk=32)
    if "linear_num_key_heads" in config:
        # Gated delta-net: 2 key heads each read by 2 of the 4 value heads, key and value widths apart.
        small.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)
    if "mamba_num_heads" in config:
        # Mamba-2: 8 heads of 8 in 2 groups (so that TP 2 splits both), a state of 16; the pattern cut to the layers.
        small.update(mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, moe_shared_expert_intermediate_size=48)
        small["hybrid_override_pattern"] = config["hybrid_override_pattern"][:layers]
    if config.get("moe_latent_size"):
        small["moe_latent_size"] = 24  # latent MoE's experts' width: apart from the model's and the experts' own
    if "rotary_dim" in config:  # MiniMax-M2's rope on part of each head, as its config says it
        small["rotary_dim"] = small.get("head_dim", 16) // 2
    if "attn_type_list" in config:
        small["attn_type_list"] = config["attn_type_list"][:layers]
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
    weight_std: float = 0.05,
) -> Path:
    """A random-init model of `config` saved by transformers' `save_pretrained` (several shards when
    `max_shard_size` is small), its matrices at `weight_std` (0.1 for attention far from uniform over a test's
    prompts). MoE experts are saved one tensor per expert as on the hub, or with `fused_experts` in the layout
    transformers v5 holds in memory (3-D tensors of all experts). Kimi-K2.5, which transformers does not build, is
    made as _kimi_k25_checkpoint says, in one file."""
    import torch
    import transformers

    if config.get("model_type") == "kimi_k25":
        return _kimi_k25_checkpoint(config, Path(out_dir), seed, dtype, fused_experts, weight_std)
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**as_transformers_builds(config))
    # An image-text checkpoint (text_config beside vision_config) is made whole, vision tower included.
    auto = transformers.AutoModelForImageTextToText if "text_config" in config else transformers.AutoModelForCausalLM
    model = auto.from_config(hf_config, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():
        for parameter in model.parameters():
            # Norm weights of ones and zero biases would hide mistakes in their mapping.
            parameter.normal_(0.0, weight_std if parameter.dim() > 1 else 0.5).add_(1.0 if parameter.dim() == 1 else 0.0)
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
    keep_remote_code_identity(config, out_dir)
    return out_dir


def kimi_k25_vision(vision: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Kimi-K2.5's vision tower (MoonViT: a patch embedding and its position embedding, pre-norm blocks of fused-qkv
    attention and a two-layer MLP, a final norm) and its projector (a norm, then two linear layers over 2 x 2 merged
    patches), by name and shape as the release stores them (vLLM's kimi_k25_vit.py and kimi_k25.py load them so)."""
    width, inner, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = width * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    shapes = {
        "vision_tower.patch_embed.proj.weight": (width, 3, patch, patch), "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width),
    }
    for block in range(vision["vt_num_hidden_layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}."
        for name, shape in (("norm0", (width,)), ("norm1", (width,)), ("wqkv", (3 * width, width)), ("wo", (width, width)),
                            ("mlp.fc0", (inner, width)), ("mlp.fc1", (width, inner))):
            shapes.update({f"{prefix}{name}.weight": shape, f"{prefix}{name}.bias": shape[:1]})
    for name, shape in (("vision_tower.encoder.final_layernorm", (width,)), ("mm_projector.pre_norm", (width,)),
                        ("mm_projector.proj.0", (merged, merged)), ("mm_projector.proj.2", (vision["text_hidden_size"], merged))):
        shapes.update({f"{name}.weight": shape, f"{name}.bias": shape[:1]})
    return shapes


def _kimi_k25_checkpoint(config: dict[str, Any], out_dir: Path, seed: int, dtype: str, fused_experts: bool, weight_std: float) -> Path:
    """Kimi-K2.5, whose image-text model transformers does not build: its language model made by transformers from
    its text_config (a DeepSeek-V3) and stored under `language_model.` as the release stores it, beside random tensors
    of its vision tower and projector (kimi_k25_vision); config.json is `config`, in one file."""
    import torch
    from safetensors.torch import load_file, save_file

    from mconvert.mappings.kimi_k25 import LANGUAGE_MODEL

    config = {**config, "text_config": {**config["text_config"], "dtype": dtype}}
    text = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    make_hf_checkpoint(text, out_dir, seed=seed, dtype=dtype, fused_experts=fused_experts, weight_std=weight_std)
    tensors = {LANGUAGE_MODEL + name: tensor for name, tensor in load_file(out_dir / "model.safetensors").items()}
    generator = torch.Generator().manual_seed(seed)
    for name, shape in kimi_k25_vision(config["vision_config"]).items():
        values = torch.randn(shape, generator=generator)
        tensors[name] = (values * weight_std if len(shape) > 1 else values * 0.5 + 1.0).to(getattr(torch, dtype))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def add_mtp_layers(hf_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Give a checkpoint made by `make_hf_checkpoint` the multi-token prediction layers the hub holds and
    transformers never builds: those its config names (`num_nextn_predict_layers`) as DeepSeek-V3 and GLM-4.5 hold
    them, HF layers num_hidden_layers + m, or the one of a family that keeps it apart (Qwen3-Next, Qwen3.5: `mtp.`);
    each with a decoder layer like the last one (random values), or blocks like the decoder's last of their kind
    (Nemotron 3 Super's, an HF layer each), its own tensors (norms, eh_proj) and copies of the embedding and output
    head where the family stores them. Written to `mtp.safetensors` beside `model.safetensors`, with an index of both."""
    import dataclasses

    import torch
    from safetensors.torch import load_file, save_file

    from mconvert.mappings import get_mapping
    from mconvert.mappings.family import mtp_blocks, mtp_position

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    family, spec = get_mapping(config)
    table, hidden = family.table, spec.hidden_size
    model = load_file(hf_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)

    def random_like(tensor):
        values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        return (values * 0.05 if tensor.dim() > 1 else values * 0.5 + 1.0).to(tensor.dtype)

    def like(layer: int) -> str:
        """The prefix of the decoder layer that MTP HF layer `layer` is made like."""
        if spec.layer_blocks is None:
            return table.layer_prefix.format(layer=spec.num_layers - 1)
        return table.layer_prefix.format(layer=spec.layer_blocks.rindex(spec.mtp_blocks[mtp_position(spec, layer)[1]]))

    hf_of = {entry.mcore: entry.hf_names[0] for entry in table.model}
    # The model's dtype, as its embedding holds it (a router's bias may be stored in fp32 beside bf16 weights).
    dtype = model[hf_of["embedding.word_embeddings.weight"]].dtype
    mtp = {}
    spec = dataclasses.replace(spec, mtp_layers=1 if table.mtp_prefix else config.get("num_nextn_predict_layers") or 0)
    for layer in range(spec.num_layers, spec.num_layers + spec.mtp_layers * mtp_blocks(spec)):
        held, last = table.layer(spec, layer), like(layer)
        mtp.update({held.prefix + name[len(last) :]: random_like(t) for name, t in model.items() if name.startswith(last)})
        for entry in held.mtp:
            shape = (hidden, 2 * hidden) if entry.mcore == "eh_proj.weight" else (hidden,)
            mtp[held.mtp_prefix + entry.hf_names[0]] = random_like(torch.empty(shape, dtype=dtype))
        for entry in held.mtp_copies:
            mtp[held.mtp_prefix + entry.hf_names[0]] = model[hf_of[entry.mcore]].clone()
    save_file(mtp, hf_dir / "mtp.safetensors", metadata={"format": "pt"})
    # Two files: an index says which holds what, as the hub's shards are listed.
    weight_map = {name: "model.safetensors" for name in model} | {name: "mtp.safetensors" for name in mtp}
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return hf_dir


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens (`w0` ... and `[UNK]` last) in HF's files, made offline:
    what transformers' AutoTokenizer and Megatron-LM's HuggingFaceTokenizer load from a model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)


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
        from mconvert.full_size import write_random_hf_checkpoint

        if options.layers:
            config["num_hidden_layers"] = options.layers
        write_random_hf_checkpoint(config, options.out, seed=options.seed)
    else:
        make_hf_checkpoint(shrink(config, layers=options.layers or 2), options.out, seed=options.seed)
    print(options.out)


if __name__ == "__main__":
    main()
