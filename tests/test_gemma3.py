"""Gemma 3's config rules, flags and export, with megatron-core 0.16.1 (its logits: tests/megatron_lm/test_gemma3.py,
megatron-core 0.19.2, whose MuP settings hold Gemma's embedding multiplier and attention scale).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.errors import ConversionError
from mconvert.mappings import gemma3, get_mapping
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.synthetic import real_config, shrink
from tests.cli_runner import assert_one_line_error, run_cli
from tests.test_parallel import hf_tensors

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 4
TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))  # three windows long
SPEC_FLAG = "--spec mconvert.megatron_lm.layer_specs gpt_layers_of_gemma3"
# name: (config, layers, config overrides, layout). Windows of 4 tokens on three layers in four; query_pre_attn_scalar
# stays 256 (the heads are 32 wide), rope_local_base_freq 10000 and rope_theta 1e6 as in every release.
MODELS = {
    "gemma3-text-tp2pp2": ("gemma-3-1b-pt", 4, {"sliding_window": WINDOW, "layer_types": [SLIDING, FULL, SLIDING, SLIDING]}, Parallelism(tp=2, pp=2)),
    "gemma3-vision-tp2": ("gemma-3-4b-it", 4, {"sliding_window": WINDOW, "layer_types": [SLIDING, SLIDING, FULL, SLIDING]}, Parallelism(tp=2)),
}


@pytest.fixture(scope="module")
def made(hf_model_factory):
    def make(name):
        config, layers, overrides, _ = MODELS[name]
        return hf_model_factory(config, layers=layers, weight_std=0.1, **overrides)

    return make


@pytest.mark.parametrize("name", MODELS)
def test_the_export_is_bit_exact_and_its_config_reads_as_the_original(name, made, tmp_path):
    """Back from the stored args alone (the text model), or with the original as --hf-config (the image-text
    checkpoint: its class, the vision tower and the projector copied from there)."""
    hf, parallelism = made(name), MODELS[name][3]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    assert read_args(iteration_dir(tmp_path / "mcore")).spec == SPEC_FLAG.split()[1:]
    vision = name.startswith("gemma3-vision")
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config_dir=hf if vision else None)
    original, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (transformers.AutoConfig.from_pretrained(d) for d in (tmp_path / "back", hf))
    assert type(written) is type(read) and written.architectures == read.architectures
    written, read = (config.get_text_config() for config in (written, read))
    for field in ("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "head_dim", "hidden_activation",
                  "rms_norm_eps", "num_key_value_heads", "tie_word_embeddings", "final_logit_softcapping", "attn_logit_softcapping"):
        assert getattr(written, field) == getattr(read, field), field


def test_the_flags_name_the_layer_spec_the_windows_and_the_two_scales(made, tmp_path):
    out = run_cli("hf-to-mcore", "--load-dir", made("gemma3-vision-tp2"), "--save-dir", tmp_path / "mcore", "--tp", "2")
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "mcore" / "megatron_args.sh").read_text()
    assert SPEC_FLAG in script and "--qk-layernorm" in script and "--apply-layernorm-1p" in script
    assert f"--window-size {WINDOW - 1},0" in script and "--window-attn-skip-freq '[1,1,0,1]'" in script
    assert "--rotary-base 1000000" in script and "--rotary-seq-len-interpolation-factor 8" in script
    # sqrt(64) = 8 and 1/sqrt(256) = sqrt(32 / 256) / sqrt(32): MuP's multiplier and its scale of a head of 32.
    assert "--use-mup" in script and "--mup-embedding-mult 8" in script
    assert "--mup-attn-scale-power 0.5" in script and "--mup-base-head-dim 0.125" in script


@pytest.mark.parametrize("config", ["gemma-3-1b-pt", "gemma-3-4b-it"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_embedding_multiplier_is_transformers_in_the_weights_dtype(config, dtype):
    """transformers multiplies the embeddings by sqrt(hidden_size) cast to the weights' dtype: bf16 34.0 for
    gemma-3-1b's 1152, 50.5 for gemma-3-4b's 2560."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    spec = get_mapping(real_config(config))[1]
    theirs = Gemma3TextScaledWordEmbedding(4, spec.hidden_size, 0, embed_scale=spec.hidden_size**0.5).to(dtype)
    args = megatron_args(spec, Parallelism(), dtype, "transformer_engine")
    assert args.mup_embedding_mult == theirs.embed_scale.to(dtype).item()
    assert args.mup_embedding_mult != spec.hidden_size**0.5


def text_config(**fields) -> dict:
    return {**shrink(real_config("gemma-3-1b-pt"), layers=6), **fields}


# config.json fields of each layer type's rope, as hub configs (rope_theta, rope_local_base_freq, rope_scaling) and
# transformers v5 (rope_parameters by layer type) write them.
HUB_ROPE = {"rope_theta": 1_000_000, "rope_local_base_freq": 10_000}
ROPES = {
    "hub": HUB_ROPE,
    "hub, linear x8": {**HUB_ROPE, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "hub, defaults": {},
    "v5": {"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
}


@pytest.mark.parametrize("rope", ROPES)
def test_each_layer_types_rope_and_the_layer_pattern_are_read_as_transformers_reads_them(rope):
    config = {key: value for key, value in text_config().items() if key not in ("rope_parameters", "layer_types")}
    config.update(ROPES[rope], sliding_window_pattern=3)
    theirs = transformers.Gemma3TextConfig.from_dict(config)
    ours = gemma3.rope_by_layer_type(config)
    assert {kind: {k: float(v) if k != "rope_type" else v for k, v in ours[kind].items()} for kind in gemma3.LAYER_TYPES} == {
        kind: {k: float(v) if k != "rope_type" else v for k, v in theirs.rope_parameters[kind].items()} for kind in gemma3.LAYER_TYPES
    }
    spec = get_mapping(config)[1]
    assert spec.sliding_layers == tuple(kind == SLIDING for kind in theirs.layer_types)
    assert spec.rope_theta == theirs.rope_parameters[FULL]["rope_theta"]
    assert spec.sliding_window_rope_theta == theirs.rope_parameters[SLIDING]["rope_theta"]


@pytest.mark.parametrize("fields, names", [
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping 30.0", "megatron-core", "no logit softcapping"]),
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping 50.0", "megatron-core", "no logit softcapping"]),
    ({"rope_local_base_freq": 20_000, "rope_parameters": None}, ["rope theta 20000", "megatron-core has one rope", "theta 10000"]),
])
def test_what_megatron_core_cannot_say_is_one_line(fields, names, made, tmp_path):
    hf = made("gemma3-text-tp2pp2")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").symlink_to(hf / "model.safetensors")
    config = {**json.loads((hf / "config.json").read_text()), **fields}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None or "softcapping" in k}))
    result = run_cli("hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out")
    assert_one_line_error(result, *names)
    assert not (tmp_path / "out").exists()


def test_megatron_core_016_lacks_mup_and_says_so(made, tmp_path):
    """megatron-core 0.16.1 has no MuP settings, so no place for Gemma's embedding multiplier: verify's model config
    says so (one line on the command line, as every ConversionError)."""
    from mconvert.verify.distributed import ParallelLayout
    from mconvert.verify.megatron_model import transformer_config_from_args

    convert_hf_to_mcore(made("gemma3-text-tp2pp2"), tmp_path / "mcore")
    args = read_args(iteration_dir(tmp_path / "mcore"))
    with pytest.raises(ConversionError, match="megatron-core 0.16.1 cannot build .* no use_mup .* later megatron-core"):
        transformer_config_from_args(args, torch.float32, "local", perform_initialization=False, layout=ParallelLayout(1, 1, 1, 1))
