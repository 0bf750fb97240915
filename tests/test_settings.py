"""The settings table (mconvert.megatron_lm.settings) both ways: every family's ModelSpec, written as Megatron-LM args
and read back, is the same model; every arg written is a row of the table. (Megatron-LM's parser checks the rows in
tests/megatron_lm/test_settings.py.)"""

from __future__ import annotations

from importlib import resources

import pytest

from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.megatron_lm.settings import BY_ARG
from mconvert.megatron_lm.spec_from_args import spec_from_args
from mconvert.synthetic import real_config, shrink

CONFIGS = sorted(path.name.removesuffix(".json") for path in resources.files("mconvert").joinpath("configs").iterdir())
LAYOUTS = [Parallelism(tp=2), Parallelism(tp=2, ep=2, model_class="hybrid")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["gpt", "hybrid"])
@pytest.mark.parametrize("name", CONFIGS)
def test_every_familys_spec_comes_back_from_its_args(name, layout):
    family, spec = get_mapping(shrink(real_config(name), layers=4))
    if spec.layer_blocks is not None and layout.model_class == "gpt":
        pytest.skip("a model of one block a layer (Mamba) is a HybridModel only")
    if layout.model_class == "hybrid" and spec.rope_scaling is not None and spec.rope_scaling.kind == "llama3":
        pytest.skip("HybridModel takes no llama3 rope scaling")
    if layout.model_class == "hybrid" and spec.rotary_interleaved:
        pytest.skip("HybridModel builds its rope without rotary_interleaved")
    if layout.model_class == "hybrid" and spec.norms_before_sublayers and spec.norms_after_sublayers:
        pytest.skip("mconvert's Gemma 3 layer spec has no HybridModel stack")
    args = megatron_args(spec, layout, spec.dtype, "transformer_engine")
    assert spec_from_args(args, family.name) == spec
    assert set(vars(args)) <= set(BY_ARG) | {s.stored_as for s in BY_ARG.values() if s.stored_as}
