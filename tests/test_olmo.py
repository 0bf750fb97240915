"""OLMo 2 converted to torch_dist and judged by megatron-core 0.16.1 (its GPTModel, local spec, gloo CPU ranks) at TP
2: no norm before the attention or the MLP, an RMSNorm on each one's output before the residual add, and q and k each
normalised over all heads of the layer (mconvert's layer spec, which Megatron-LM loads by `--spec`). The norm weights
are far from ones (make_hf_checkpoint), the matrices at std 0.1. A planted fault is caught: the same checkpoint in
layers whose norms come before their sublayers moves megatron-core's logits; q/k norms per head would move
transformers' own far beyond the comparison's tolerance. The way back is bit-exact from the stored args. In bf16, the
q/k norms give transformers' bits (the weight applied in fp32, before the cast back)."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import real_config
from mconvert.verify.distributed import run_ranks
from tests.cli_runner import run_cli
from tests.test_minimax_m2 import per_head
from tests.test_moe_megatron import megatron_view

TOKENS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
OLMO2 = "olmo-2-1124-7b-instruct"
MODELS = {"olmo2-tp2": (2, {}, Parallelism(tp=2))}
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
def test_megatron_core_gives_transformers_logits_and_the_way_back_is_bit_exact(name, made, tmp_path):
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
    """In each rank: megatron_view with mconvert's layer spec planted wrong: the same norms, loaded from the same
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


def test_norms_before_the_sublayers_move_megatrons_logits(made, tmp_path):
    hf, parallelism = made("olmo2-tp2"), MODELS["olmo2-tp2"][2]
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    logits = megatron_logits(tmp_path / "mcore", parallelism, megatron_view_with_norms_before_the_sublayers)
    assert (logits - hf_logits(hf)).abs().max() > 1e-2


def test_q_k_norms_per_head_move_transformers_logits(made):
    """The prompts are such that the comparisons above would catch q/k norms over each head alone."""
    hf = made("olmo2-tp2")
    model, reference = hf_model(hf), hf_logits(hf)
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.forward = lambda x, norm=norm: per_head(x, norm.weight, norm.variance_epsilon, 4)
    with torch.no_grad():
        assert (model(TOKENS).logits - reference).abs().max() > 1e-2


def test_the_flags_name_the_layer_spec(made, tmp_path):
    out = run_cli("hf-to-mcore", "--load-dir", made("olmo2-tp2"), "--save-dir", tmp_path / "mcore", "--tp", "2")
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "mcore" / "megatron_args.sh").read_text()
    assert SPEC_FLAG in script and "--qk-layernorm" in script and "install mconvert where Megatron-LM runs" in script


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
