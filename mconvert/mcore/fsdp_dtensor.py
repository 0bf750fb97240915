"""Megatron-FSDP's checkpoint format, `fsdp_dtensor` (megatron-core's transformer/fsdp_dtensor_checkpoint.py and
Megatron-LM 0.19's training/checkpointing.py): a plain DCP folder of the training state, flattened with dots.

- The model's tensors under `model.module.<name>`, the model's own names, each whole (its global shape at any TP,
  EP or data-parallel size); experts by their global number; a SwiGLU fc1's weight or bias split into
  `<name>_w` (the gate half) and `<name>_v` (the up half); no `_extra_state`.
- The optimizer's state under `optimizer.state.<param>.exp_avg` / `.exp_avg_sq`, and each parameter's group
  settings under `optimizer.param_to_group_meta.<param>.<setting>`, `step` among them, `<param>` the name the
  wrapped model gives the parameter (`_param_name`: unsplit, experts global).
- `args`, `iteration`, `checkpoint_version`, the RNG and scheduler states, as torch.save'd objects.

Megatron-LM 0.19.2 starts a Megatron-FSDP run from such a checkpoint as the resumption of a run, never from weights
alone (mconvert.megatron_lm.flags.load_flags says why). A conversion is then iteration 0 of that run: the weights,
its `args`, and Adam's step count at 0 for every parameter, the state of an optimizer that has not stepped.
Megatron-FSDP's load makes the rest itself: it takes one step with zero gradients before it loads, which leaves
Adam's moments at zero and the step count at 1; the step written here puts it back to 0.
"""

from __future__ import annotations

import re

FORMAT = "fsdp_dtensor"
MODEL_PREFIX = "model.module."
# The fc1 tensors Megatron-FSDP splits into halves (its is_swiglu_key): dense, shared expert, an expert's.
SWIGLU_FC1 = re.compile(
    r"\.mlp\.(?:shared_experts\.)?linear_fc1\.(?:weight|bias)$|\.mlp\.experts\.linear_fc1\.(?:weight|bias)\d+$"
    r"|\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.(?:weight|bias)$"
)
# A stored half of such a tensor: (the tensor's name, "w" or "v").
HALF = re.compile(r"^(.*\.linear_fc1\.(?:weight|bias)\d*)_([wv])$")
# The wrappers around the model whose levels the optimizer's parameter names carry: Megatron-FSDP's two, and in
# bf16 or fp16 Megatron-LM's Float16Module inside them. Step counts are written under both, so that a run in
# either precision finds them; the one it does not ask for is not read.
PARAM_PREFIXES = ("module.module.module.", "module.module.")


def stored_halves(name: str, rows: int, swiglu: bool) -> list[tuple[str, slice]]:
    """The keys that hold the model's tensor `name` of `rows` rows, with the rows each holds."""
    if swiglu and SWIGLU_FC1.search(name):
        return [(MODEL_PREFIX + name + "_w", slice(0, rows // 2)), (MODEL_PREFIX + name + "_v", slice(rows // 2, rows))]
    return [(MODEL_PREFIX + name, slice(None))]


def step_keys(name: str) -> list[str]:
    """The keys of Adam's step count for the model's parameter `name`."""
    return [f"optimizer.param_to_group_meta.{prefix}{name}.step" for prefix in PARAM_PREFIXES]
