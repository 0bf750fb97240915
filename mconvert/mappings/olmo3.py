"""OLMo 3 (`olmo3`, transformers' Olmo3ForCausalLM): OLMo 2's layers and tensors (its table), with a sliding window
on the layers `layer_types` marks (three in four by default) and a rope for each layer type.

megatron-core applies one rope to every layer (GPTModel's one RotaryEmbedding), so the layer types in use must
share theta and scaling. transformers 5.24 reads a hub config's `rope_theta` and `rope_scaling` into the
full-attention layers' rope only, the sliding-window layers keeping theta 500000 unscaled: a released OLMo 3 with
YaRN on its full-attention layers is refused.
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import ConversionError
from mconvert.mappings import gpt_oss, olmo2
from mconvert.mappings.family import Family
from mconvert.mappings.rope import read_rope
from mconvert.mappings.spec import ModelSpec, require, write_dense_config

LAYER_TYPES = ("sliding_attention", "full_attention")
# Olmo3Config's defaults: the window, and the theta of a layer type whose rope says none.
DEFAULT_WINDOW = 4096
DEFAULT_THETA = 500000.0


def rope_by_layer_type(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's rope parameters as transformers 5.24 reads them (Olmo3Config.convert_rope_params_to_dict):
    `rope_parameters` by layer type, `rope_scaling` added to the full-attention layers', `rope_theta` the
    full-attention layers' theta where theirs says none."""
    params = config.get("rope_parameters") or {}
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(config.get("rope_scaling") or {})}
    full.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    sliding = {"rope_type": "default", "rope_theta": DEFAULT_THETA, **(params.get("sliding_attention") or {})}
    return {"full_attention": full, "sliding_attention": sliding}


def read_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    num_layers = require(config, "num_hidden_layers", source)
    kinds = config.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
    window = config.get("sliding_window", DEFAULT_WINDOW)
    layers = gpt_oss.sliding_layers({"layer_types": kinds}, num_layers, source) if window is not None else (False,) * num_layers
    ropes = {kind: read_rope({"rope_parameters": rope}, source) for kind, rope in rope_by_layer_type(config).items() if kind in kinds}
    if len(set(ropes.values())) > 1:
        said = "; ".join(f"{kind} layers theta {theta:g}, {scaling.kind if scaling else 'no'} scaling" for kind, (theta, scaling) in ropes.items())
        raise ConversionError(
            f"{source}: OLMo 3's layer types have different rope ({said}): megatron-core applies one rope to every "
            "layer and has no rope per layer"
        )
    theta, scaling = next(iter(ropes.values()))
    return olmo2.read_dense_olmo_spec(
        {**config, "rope_parameters": None, "rope_scaling": None}, "olmo3", source, rope_theta=theta, rope_scaling=scaling,
        sliding_window=int(window) if any(layers) else None, sliding_layers=layers if any(layers) and not all(layers) else None,
    )


def write_config(spec: ModelSpec) -> dict[str, Any]:
    config = write_dense_config(spec, "olmo3", "Olmo3ForCausalLM")
    layers = spec.sliding_layers or (spec.sliding_window is not None,) * spec.num_layers
    config.pop("use_sliding_window", None)
    # Every layer type's rope, since transformers 5.24 gives the sliding-window layers theta 500000 where it names none.
    rope = {"rope_type": "default", **(config["rope_scaling"] or {}), "rope_theta": spec.rope_theta}
    config.update(
        sliding_window=spec.sliding_window or spec.hf_config.get("sliding_window", DEFAULT_WINDOW),
        layer_types=["sliding_attention" if windowed else "full_attention" for windowed in layers],
        rope_parameters={kind: dict(rope) for kind in LAYER_TYPES},
    )
    return config


FAMILY = Family(
    name="olmo3",
    model_types=("olmo3",),
    model_sizes=("olmo3", "olmo-3"),
    table=olmo2.TABLE,
    read_config=read_config,
    write_config=write_config,
    architectures=(("Olmo3ForCausalLM", "olmo3"),),
)
