"""Megatron-Bridge's adapters of routed experts as PEFT adapters of transformers' fused 3-D expert parameters
(`target_parameters`, PEFT's ParamWrapper).

transformers v5 holds a layer's experts as 3-D parameters (Qwen3-MoE's `mlp.experts.gate_up_proj` [E, 2F, H] and
`down_proj` [E, H, F]: the family table's `fused_experts`), so PEFT on the HF base adapts them as parameters, not
as per-expert modules. PEFT 0.21's ParamWrapper holds one lora_A [E x r, in], read as [E, r, in] (expert-major), and
one lora_B [out, r x E], read as [out, r, E] (rank-major: column k x E + e is expert e's rank k), and adds
alpha / r x B_e A_e to expert e's slice; vLLM's `_stack_moe_lora_weights` reads the same. Megatron-Bridge's save
holds an adapter per expert (megatron-core's local experts) along the stacked weight's expert axis, each expert's
A_e [r, in] and B_e [out, r]; they are stacked here as PEFT reads them (Megatron-Bridge's own HF export of grouped
experts writes lora_B expert-major, which PEFT reads as other experts' ranks).
"""

from __future__ import annotations

import numpy as np

from mconvert.converters.bridge_adapters import ADAPTER, AdapterSave
from mconvert.errors import ConversionError
from mconvert.mappings.family import Family
from mconvert.mappings.spec import ModelSpec
from mconvert.mappings.transforms import Rename
from mconvert.mcore.layout import EXPERTS_PREFIX, layer_key

EXPERT_SLICE = "[{expert}]"


def expert_peft_tensors(save: AdapterSave, family: Family, spec: ModelSpec, layer: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """The PEFT tensors of `layer`'s adapted expert parameters and those parameters' HF names."""
    table_layer = family.table.layer(spec, layer, fused_expert_layers=frozenset(range(spec.num_layers)))
    adapted = []
    for entry in table_layer.experts:
        key, offsets = layer_key(EXPERTS_PREFIX + entry.mcore, layer, spec)
        key = key.removesuffix(".weight")
        if not entry.mcore.endswith(".weight") or not save.has(key):
            continue
        if not (isinstance(entry, Rename) and entry.hf.endswith(EXPERT_SLICE)):
            raise ConversionError(
                f"'{key}{ADAPTER}': PEFT adapts a fused expert parameter whole, and {family.name}'s fused experts are not "
                f"Megatron's expert weights as they are ({type(entry).__name__} {entry.hf_names[0]})"
            )
        adapted.append((entry, key, offsets))
    params = [table_layer.prefix + entry.hf.removesuffix(EXPERT_SLICE) for entry, _, _ in adapted]
    tensors: dict[str, np.ndarray] = {}
    for param, (entry, key, offsets) in zip(params, adapted):
        experts = [part for expert in range(spec.moe.num_experts) for part in save.parts(key, (*offsets, expert), entry)]
        if any(part.magnitude is not None for part in experts):
            raise ConversionError(f"'{key}{ADAPTER}weight_magnitude': DoRA on experts has no PEFT form (PEFT's ParamWrapper takes no DoRA)")
        a = np.concatenate([part.a for part in experts])  # [E x r, in], expert-major
        b = np.stack([part.b for part in experts], axis=-1)  # [out, r, E]
        module = param.rpartition(".")[0]
        # PEFT nests one ParamWrapper per targeted parameter of a module, the first it wraps innermost (`base_layer.`
        # once per wrapper around it): it wraps them in the order the module defines them, which the table's
        # `fused_experts` keeps (gate_up_proj, then down_proj).
        same_module = [p for p in params if p.rpartition(".")[0] == module]
        nest = "base_layer." * (len(same_module) - 1 - same_module.index(param))
        tensors[f"base_model.model.{module}.{nest}lora_A.weight"] = a
        tensors[f"base_model.model.{module}.{nest}lora_B.weight"] = np.ascontiguousarray(b.reshape(b.shape[0], -1))
    return tensors, params

