"""Faults injected into an HF PEFT adapter on disk, for the adapter tests (tests/test_adapters.py,
tests/test_swift_adapters.py): each must fail the check that peft's model gives the tool's own."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from mconvert.converters.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def swap_orientation(adapter: Path) -> None:
    """lora_A written as lora_B's transpose and lora_B as lora_A's (where the shapes still load: o_proj's)."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    for name in [n for n in tensors if n.endswith("o_proj.lora_A.weight")]:
        b_name = name.replace("lora_A", "lora_B")
        tensors[name], tensors[b_name] = tensors[b_name].T.contiguous(), tensors[name].T.contiguous()
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS))


def wrong_scaling(adapter: Path) -> None:
    """lora_alpha written as the rank: a scale of 1 where the tool's is 2 (alpha 16, rank 8)."""
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(dict(config, lora_alpha=config["r"])))
