"""OLMo 2 and OLMo 3 converted to torch_dist and checked by megatron-core 0.16.1 (its GPTModel, local spec, gloo CPU
ranks) at TP 2 and PP 2: no norm before the attention or the MLP, an RMSNorm on each one's output before the residual
add, and q and k each normalised over all heads of the layer (mconvert's layer spec, which Megatron-LM loads by
`--spec`); OLMo 3's windows on three layers in four, the prompts three windows long. The norm weights are far from
ones (make_hf_checkpoint), the matrices at std 0.1. Injected faults are caught: the same checkpoint in layers whose norms
come before their sublayers, and OLMo 3's window on the other layers, move megatron-core's logits; q/k norms per head
would move transformers' own far beyond the comparison's tolerance. The export is bit-exact from the stored args. In
bf16, the q/k norms give transformers' bits (the weight applied in fp32, before the cast back)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping, olmo3
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import real_config, shrink
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import assert_one_line_error, run_cli
from tests.test_gpt_oss import stored_args_changed
from tests.test_minimax_m2 import per_head
from tests.test_moe_megatron import megatron_view

WINDOW = 4
TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))  # three windows long
OLMO2 = "olmo-2-1124-7b-instruct"
# OLMo 3 as transformers' defaults make it (three sliding-window layers, then a full one), from OLMo 2's config, with
# grouped-query attention (its 32B's), so that the key norm spans fewer heads than the query's.
OLMO3 = {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "sliding_window": WINDOW, "num_key_value_heads": 2}
MODELS = {"olmo2-tp2": (2, {}, Parallelism(tp=2)), "olmo3-pp2": (4, OLMO3, Parallelism(pp=2))}
SPEC_FLAG = "--spec mconvert.megatron_lm.layer_specs gpt_layers_with_norms_after_sublayers"


@pytest.fixture(scope="module")
def made(hf_model_factory):
    def make(name):
        layers, overrides, _ = MODELS[name]
        return hf_model_factory(OLMO2, layers=layers, weight_std=0.1, **overrides)

    return make


def hf_model(hf_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def hf_logits(hf_dir) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(hf_dir)(TOKENS).logits


def megatron_logits(ckpt, parallelism: Parallelism, view=megatron_view) -> torch.Tensor:
    views = run_ranks(view, {"model": str(ckpt)}, TOKENS, tp=parallelism.tp, pp=parallelism.pp)
    return views["model"][0][..., :1000]


@pytest.mark.parametrize("name", MODELS)
def test_megatron_core_gives_transformers_logits_and_the_export_is_bit_exact(name, made, tmp_path):
    hf, parallelism = made(name), MODELS[name][2]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    torch.testing.assert_close(megatron_logits(tmp_path / "mcore", parallelism), hf_logits(hf), rtol=1e-4, atol=1e-4)
    assert read_args(iteration_dir(tmp_path / "mcore")).spec == SPEC_FLAG.split()[1:]
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")  # from the stored args alone
    original = load_file(hf / "model.safetensors")
    back = {k: v for path in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(path).items()}
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (transformers.AutoConfig.from_pretrained(d) for d in (tmp_path / "back", hf))
    for field in ("model_type", "num_key_value_heads", "rms_norm_eps", "layer_types", "sliding_window", "rope_parameters"):
        assert getattr(written, field, None) == getattr(read, field, None), field


def megatron_view_with_norms_before_the_sublayers(ckpt_dirs: dict[str, str], tokens: torch.Tensor):
    """In each rank: megatron_view with mconvert's layer spec made wrong: the same norms, loaded from the same
    checkpoint keys, before the attention and the MLP (megatron-core's own places) instead of after them."""
    from megatron.core.models.backends import LocalSpecProvider

    from mconvert.megatron_lm import layer_specs

    right = layer_specs.with_norms_after_sublayers

    def norms_before(spec, transformer_engine):
        for layer in layer_specs._layers(right(spec, transformer_engine)):
            attention, mlp = layer.submodules.self_attention.submodules, layer_specs._mlp_submodules(layer.submodules.mlp)
            attention.linear_proj, mlp.linear_fc2 = attention.linear_proj.__base__, mlp.linear_fc2.__base__
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = LocalSpecProvider().layer_norm(rms_norm=True)
            layer.submodules.sharded_state_dict_keys_map = {
                "input_layernorm.": "self_attention.linear_proj.post_layernorm.", "pre_mlp_layernorm.": "mlp.linear_fc2.post_layernorm.",
            }
        return spec

    layer_specs.with_norms_after_sublayers = norms_before
    return megatron_view(ckpt_dirs, tokens)


@pytest.mark.parametrize("fault", ["norms before the sublayers", "window on the other layers"])
def test_an_injected_fault_moves_megatrons_logits(fault, made, tmp_path):
    name = "olmo2-tp2" if fault == "norms before the sublayers" else "olmo3-pp2"
    hf, parallelism = made(name), MODELS[name][2]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    view = megatron_view
    if fault == "norms before the sublayers":
        view = megatron_view_with_norms_before_the_sublayers
    else:
        assert read_args(iteration_dir(tmp_path / "mcore")).window_attn_skip_freq == [1, 1, 1, 0]
        stored_args_changed(tmp_path / "mcore", window_attn_skip_freq=[0, 0, 0, 1])
    assert (megatron_logits(tmp_path / "mcore", parallelism, view) - hf_logits(hf)).abs().max() > 1e-2


def test_q_k_norms_per_head_or_a_window_as_long_as_the_prompts_move_transformers_logits(made, tmp_path):
    """The prompts are such that the comparisons above would catch q/k norms over each head alone, or OLMo 3's
    window lost."""
    hf = made("olmo3-pp2")
    model, reference = hf_model(hf), hf_logits(hf)
    for layer in model.model.layers:
        for norm, heads in ((layer.self_attn.q_norm, 4), (layer.self_attn.k_norm, 2)):
            norm.forward = lambda x, norm=norm, heads=heads: per_head(x, norm.weight, norm.variance_epsilon, heads)
    with torch.no_grad():
        assert (model(TOKENS).logits - reference).abs().max() > 1e-2
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "model.safetensors").symlink_to(hf / "model.safetensors")
    (wide / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), "sliding_window": len(TOKENS[0])}))
    assert (hf_logits(wide) - reference).abs().max() > 1e-2


def test_the_flags_name_the_layer_spec_and_the_windows(made, tmp_path):
    out = run_cli("hf-to-mcore", "--load-dir", made("olmo3-pp2"), "--save-dir", tmp_path / "mcore", "--pp", "2")
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "mcore" / "megatron_args.sh").read_text()
    assert SPEC_FLAG in script and "--qk-layernorm" in script and "install mconvert where Megatron-LM runs" in script
    assert f"--window-size {WINDOW - 1},0" in script and "--window-attn-skip-freq '[1,1,1,0]'" in script


def olmo3_config(**fields) -> dict:
    return {**shrink(real_config(OLMO2), layers=4), "model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], **fields}


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32, "beta_slow": 1}
# config.json fields of each layer type's rope, as hub configs (rope_theta, rope_scaling) and transformers v5
# (rope_parameters by layer type) write them.
ROPES = {
    "hub, one theta": {"rope_theta": 500000},
    "hub, another theta": {"rope_theta": 10000},
    "hub, YaRN": {"rope_theta": 500000, "rope_scaling": YARN},
    "v5, one theta": {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in olmo3.LAYER_TYPES}},
    "v5, full only": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}


@pytest.mark.parametrize("rope", ROPES)
def test_each_layer_types_rope_is_read_as_transformers_reads_it(rope):
    config = {key: value for key, value in olmo3_config(**ROPES[rope]).items() if key not in ("rope_scaling", "rope_theta")}
    config.update(ROPES[rope])
    theirs = transformers.Olmo3Config.from_dict(config).rope_parameters
    ours = olmo3.rope_by_layer_type(config)
    assert {kind: {k: float(v) if k != "rope_type" else v for k, v in ours[kind].items()} for kind in olmo3.LAYER_TYPES} == {
        kind: {k: float(v) if k != "rope_type" else v for k, v in theirs[kind].items()} for kind in olmo3.LAYER_TYPES
    }
    if rope in ("hub, one theta", "v5, one theta"):
        assert get_mapping(config)[1].rope_theta == float(ours["full_attention"]["rope_theta"])
    else:
        with pytest.raises(ConversionError, match="different rope .* megatron-core applies one rope to every layer"):
            get_mapping(config)


def test_yarn_on_full_attention_layers_alone_converts_and_on_some_is_one_line(tmp_path):
    """An OLMo 3 whose every layer attends fully has one rope, scaled or not; YaRN on its full-attention layers beside
    sliding-window ones (OLMo 3's releases) is refused in one line that names what megatron-core lacks."""
    spec = get_mapping(olmo3_config(rope_scaling=YARN, layer_types=["full_attention"] * 4))[1]
    assert spec.rope_scaling.kind == "yarn" and spec.sliding_window is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(olmo3_config(rope_scaling=YARN)))
    result = run_cli("hf-to-mcore", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out")
    assert_one_line_error(result, "config.json", "full_attention layers theta 500000, yarn scaling", "megatron-core applies one rope")


def test_biases_on_the_attention_alone_are_one_line():
    with pytest.raises(ConversionError, match="attention_bias=True with mlp_bias=False cannot be expressed"):
        get_mapping({**real_config(OLMO2), "attention_bias": True})


def test_the_q_k_norms_scale_in_fp32_as_olmo_2s_in_bf16():
    """OLMo 2's norms multiply the weight into the fp32 values before the cast back to bf16 (MiniMax-M2's after it):
    mconvert's q/k norms of OLMo 2's layer spec give transformers' bits, the other order does not."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from mconvert.megatron_lm import layer_specs

    config = type("Config", (), {"tensor_model_parallel_size": 1, "num_attention_heads": 4, "params_dtype": torch.bfloat16})
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 2, 4, 16, generator=generator)).bfloat16()
    weight = (1 + 0.5 * torch.randn(64, generator=generator)).bfloat16()
    theirs = Olmo2RMSNorm(64, eps=1e-6).bfloat16()
    theirs.weight.data = weight.clone()
    ours = {cls: cls(16, config, eps=1e-6) for cls in (layer_specs.QueryNormAcrossHeadsInFp32, layer_specs.QueryNormAcrossHeads)}
    for norm in ours.values():
        norm.weight.data = weight.clone()
    with torch.no_grad():
        expected = theirs(x.flatten(-2)).view_as(x)
        assert torch.equal(ours[layer_specs.QueryNormAcrossHeadsInFp32](x), expected)
        assert not torch.equal(ours[layer_specs.QueryNormAcrossHeads](x), expected)
