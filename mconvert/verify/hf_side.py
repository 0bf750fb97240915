"""The HF side of verification: transformers' own model from the HF directory, offline."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mconvert.dependencies import ACCELERATE, COMPRESSED_TENSORS, VERIFY_INSTALL, require
from mconvert.errors import ConversionError
from mconvert.formats.quantized import quantization_config
from mconvert.mappings import family_for_config, language_model_of, remote_code_architecture


@dataclass
class Outputs:
    """Per prompt: logits [seq, vocab] and each decoder layer's output [seq, hidden], fp32 on the CPU."""

    logits: list[torch.Tensor]
    hidden_states: list[list[torch.Tensor]]


@contextlib.contextmanager
def without_flash_linear_attention() -> Iterator[None]:
    """transformers takes flash-linear-attention's gated delta rule where it imports (decided as the model's module is
    imported): hidden, the reference runs its PyTorch rule in fp32, as megatron-core's side does (run_settings'
    deterministic_mode). On the GPU the two sides' Triton kernels, called differently, part by enough to flip MoE
    routing (Qwen3-Next, 4 x H200: KL 2.5e-3 over 64 tokens)."""
    saved = sys.modules.get("fla", ...)
    sys.modules["fla"] = None  # an import of it fails, find_spec finds none
    try:
        yield
    finally:
        if saved is ...:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved


def auto_class(transformers: Any, config: dict[str, Any]) -> Any:
    """The causal-LM auto class, or the image-text one for an image-text model that has no causal-LM class
    (Qwen3-VL's Qwen3VLForConditionalGeneration, run on text)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if "text_config" in config and config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_hf_model(hf_dir: str | Path, dtype: torch.dtype):
    """transformers' model of an HF directory, offline. A checkpoint that ships its own code (auto_map) under a
    model_type transformers does not know is built as the transformers class its `architectures` names, as
    mconvert reads it (mconvert.mappings.remote_code_architecture); one of a class transformers lacks whose language
    model is such a class (Kimi-K2.5) is built as its language model, from its text_config and its tensors under the
    language model's prefix (the vision tower is not built). Its own code is not run."""
    import transformers

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    options = dict(dtype=dtype, local_files_only=True, **dequantized(config, hf_dir))
    taken, inside = remote_code_architecture(config), language_model_of(config)
    if inside is not None:
        text = config["text_config"]
        taken, described = inside[:2], {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
        options["key_mapping"] = {f"^{re.escape(inside[2])}": ""}
    else:
        described = config
    with transformers_log_held() as held, without_flash_linear_attention():
        try:
            if taken is None:
                model = auto_class(transformers, config).from_pretrained(hf_dir, **options)
            else:
                family, architecture = taken
                fields = {key: value for key, value in described.items() if key not in ("auto_map", "model_type")}
                hf_config = transformers.AutoConfig.for_model(family.hf_model_type(described), **fields)
                model_class = getattr(transformers, architecture)
                if inside is not None:  # the tensors beside the language model (its vision tower) are not its own
                    left_out = [f"^{re.escape(prefix)}" for prefix, _ in family_for_config(config).table.left_out]
                    model_class = type(architecture, (model_class,), {"_keys_to_ignore_on_load_unexpected": left_out})
                model = model_class.from_pretrained(hf_dir, config=hf_config, **options)
        except (RuntimeError, ValueError) as error:  # e.g. its FP8 dequantization of blocks cut at a tensor's edge
            raise ConversionError(
                f"{Path(hf_dir)}: transformers {transformers.__version__} cannot load it as the reference: {load_failure(held, error)}"
            ) from error
    for text in held:  # a load that went through: its report as transformers would have printed it
        print(text, file=sys.stderr)
    # transformers before 5.24 keeps dequantized MXFP4 experts in bf16 whatever dtype the model is loaded in (their
    # values are exact in either): an fp32 comparison would run them in bf16.
    return model.to(dtype) if "quantization_config" in options else model


ERROR_LINE = re.compile(r"^\w+(Error|Exception): .+")
DESTINED = re.compile(r"destined for (\S+?)\.? ")


@contextlib.contextmanager
def transformers_log_held() -> Iterator[list[str]]:
    """transformers' log lines (warnings and worse, as its default handler prints them) held back in a list while
    the block runs, its default handler off."""
    import transformers

    class Held(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            texts.append(self.format(record))

    texts: list[str] = []
    handler = Held(logging.WARNING)
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.add_handler(handler)
    try:
        yield texts
    finally:
        transformers.utils.logging.remove_handler(handler)
        transformers.utils.logging.enable_default_handler()


def load_failure(held: list[str], error: Exception) -> str:
    """Why transformers failed to load a checkpoint, in one line: its load report (its conversions' tracebacks
    included) says it in its last error line and names the tensor; else the exception's first line."""
    reasons = [line.strip() for text in held for line in text.splitlines() if ERROR_LINE.match(line.strip())]
    reason = reasons[-1] if reasons else (str(error).strip().splitlines() or [type(error).__name__])[0]
    tensors = [match.group(1) for text in held for match in DESTINED.finditer(text)]
    return f"{reason} ({tensors[-1]})" if tensors else reason


def dequantized(config: dict, hf_dir: str | Path) -> dict:
    """from_pretrained's setting for a checkpoint stored quantized (DeepSeek-V3's and MiniMax-M2's FP8 blocks,
    gpt-oss's MXFP4, Kimi-K2-Thinking's pack-quantized INT4): transformers' own dequantization of its weights, the
    values mconvert converts. Running them quantized instead needs kernels that only some GPUs and extra packages have."""
    quantization = quantization_config(config)
    if not quantization:
        return {}
    from transformers.quantizers.auto import AutoQuantizationConfig

    if quantization.get("quant_method") == "fp8":
        require((ACCELERATE,), f"verify of the FP8 checkpoint {Path(hf_dir)}", VERIFY_INSTALL)
    if quantization.get("quant_method") == "compressed-tensors":
        require((COMPRESSED_TENSORS,), f"verify of the INT4 checkpoint {Path(hf_dir)}", "pip install compressed-tensors")
    return {"quantization_config": AutoQuantizationConfig.from_dict({**quantization, "dequantize": True})}


def check_rotary_dim_read(model, hf_dir: str | Path) -> None:
    """MiniMax-M2's released configs say their partial rope as `rotary_dim`, which transformers 5.17 ignores (5.24
    reads it): such a transformers runs rope on every dim of a head, another model than the checkpoint's."""
    import transformers

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    inv_freq = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "inv_freq", None)
    if "rotary_dim" in config and inv_freq is not None and 2 * inv_freq.numel() != config["rotary_dim"]:
        raise ConversionError(
            f"{Path(hf_dir) / 'config.json'}: transformers {transformers.__version__} runs rope on {2 * inv_freq.numel()} "
            f"dims of each head, where its rotary_dim says {config['rotary_dim']}: upgrade transformers (5.24 reads "
            f"rotary_dim), or add partial_rotary_factor {config['rotary_dim'] / config['head_dim']:g} to config.json"
        )


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (`model.layers`), or of the language model that an image-text class holds
    beside its vision tower (Gemma 3's Gemma3ForConditionalGeneration, `model.language_model.layers`)."""
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.language_model.layers


def hf_outputs(hf_dir: str | Path, prompts: list[torch.Tensor], dtype: torch.dtype, device: str) -> Outputs:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = load_hf_model(hf_dir, dtype)
    check_rotary_dim_read(model, hf_dir)
    model = model.to(device).eval()
    layer_outputs: dict[int, torch.Tensor] = {}

    def recorder(index: int):
        def record(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            layer_outputs[index] = hidden[0].float().cpu()

        return record

    hooks = [layer.register_forward_hook(recorder(i)) for i, layer in enumerate(decoder_layers(model))]
    outputs = Outputs([], [])
    try:
        with torch.no_grad():
            for tokens in prompts:
                logits = model(tokens[None].to(device)).logits[0]
                outputs.logits.append(logits.float().cpu())
                outputs.hidden_states.append([layer_outputs[i] for i in sorted(layer_outputs)])
    finally:
        for hook in hooks:
            hook.remove()
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return outputs
