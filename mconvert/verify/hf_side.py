"""The HF side of verification: transformers' own model from the HF directory, offline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Outputs:
    """Per prompt: logits [seq, vocab] and each decoder layer's output [seq, hidden], fp32 on the CPU."""

    logits: list[torch.Tensor]
    hidden_states: list[list[torch.Tensor]]


def hf_outputs(hf_dir: str | Path, prompts: list[torch.Tensor], dtype: torch.dtype, device: str) -> Outputs:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    layer_outputs: dict[int, torch.Tensor] = {}

    def recorder(index: int):
        def record(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            layer_outputs[index] = hidden[0].float().cpu()

        return record

    hooks = [layer.register_forward_hook(recorder(i)) for i, layer in enumerate(model.model.layers)]
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
