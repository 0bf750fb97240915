"""Families of DeepSeek-V3's experts (sigmoid routing with a bias that only chooses them, shared experts, dense
layers where the config says) beside other attention, each converted to torch_dist at TP 2 x EP 2, on weights at
std 0.1 with the expert biases random:
- GLM-4.7-Flash (`glm4_moe_lite`, the deepseek family): multi-latent attention, its dense layers where
  `mlp_layer_types` says (here not the first ones, where `first_k_dense_replace` says), its MTP layer;
- dots.llm1 (`dots1`, the glm4_moe family): Qwen3's attention, an 8-token window on the layers from
  `max_window_layers` on though `use_sliding_window` says false, as transformers reads it;
- Hy3 (`hy_v3`): GLM-4.5's features under its own tensor names, its MTP layer.
`mconvert verify` checks the same models at the same layout (tests/test_verify.py: megatron-core's GPTModel on CPU
ranks against transformers, prompts up to 64 tokens, top-2 of 8 experts), within a window where the model has one.
Here: dots.llm1's windows over prompts five times as long; the MTP layers, which transformers drops, hold the HF
tensors this test names by hand; the export is bit for bit, its config.json that of the family it came from."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mconvert.dtypes import as_torch
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.verify.distributed import run_ranks
from tests.test_moe_megatron import hf_logits, megatron_view
from tests.test_verify import FAMILIES as VERIFIED

# family: (config, layout, hf_model_factory's arguments), as verified
MODELS = {name: VERIFIED[name] for name in ("glm4_moe_lite", "dots1", "hy_v3")}

# The MTP layer's tensors in megatron-core's names, and the HF tensors of layer num_hidden_layers that they are.
MTP_LAYERS = {
    "glm4_moe_lite": {
        "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight",
        "transformer_layer.mlp.router.weight": "mlp.gate.weight",
        "transformer_layer.mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    },
    "hy_v3": {
        "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "final_layernorm.weight",
        "transformer_layer.mlp.router.weight": "mlp.router.gate.weight",
        "transformer_layer.mlp.router.expert_bias": "mlp.expert_bias",
        "transformer_layer.mlp.shared_experts.linear_fc2.weight": "mlp.shared_mlp.down_proj.weight",
    },
}

# config.json fields the export must write as the original has them.
FIELDS = {
    "glm4_moe_lite": ("model_type", "architectures", "mlp_layer_types", "n_routed_experts", "routed_scaling_factor", "q_lora_rank",
                      "qk_rope_head_dim", "rope_interleave", "num_nextn_predict_layers"),
    "dots1": ("model_type", "architectures", "layer_types", "sliding_window", "n_shared_experts", "norm_topk_prob",
              "first_k_dense_replace", "routed_scaling_factor"),
    "hy_v3": ("model_type", "architectures", "mlp_layer_types", "num_experts", "num_shared_experts", "router_scaling_factor",
              "enable_moe_fp32_combine", "num_nextn_predict_layers", "head_dim"),
}


@pytest.fixture(scope="module")
def converted(hf_model_factory, tmp_path_factory):
    """convert(name) -> (HF dir, torch_dist checkpoint at the verified layout), once per model."""
    made = {}

    def convert(name: str):
        if name not in made:
            config, parallelism, arguments = MODELS[name]
            hf = hf_model_factory(config, **arguments)
            mcore = tmp_path_factory.mktemp(name) / "mcore"
            convert_hf_to_mcore(hf, mcore, parallelism=parallelism)
            made[name] = hf, mcore
        return made[name]

    return convert


def test_dots1_windows_the_layers_transformers_windows(converted):
    """Beyond the window, which verify's prompts are cut to: megatron-core's logits over 40 tokens are transformers'."""
    hf, mcore = converted("dots1")
    tokens = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = run_ranks(megatron_view, {"dots1": str(mcore)}, tokens, tp=2, ep=2)["dots1"][0]
    torch.testing.assert_close(logits[..., :1000], hf_logits(hf, tokens), rtol=1e-4, atol=1e-4)


def hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    return {name: tensor for path in sorted(hf_dir.glob("*.safetensors")) for name, tensor in load_file(path).items()}


@pytest.mark.parametrize("name", MTP_LAYERS)
def test_the_mtp_layer_holds_the_hf_tensors_megatron_core_names(name, converted):
    hf, mcore = converted(name)
    tensors = hf_tensors(hf)
    layer = f"model.layers.{MODELS[name][2].get('layers', 2)}."  # the layer after the decoder's
    stored = DCPCheckpoint(iteration_dir(mcore))
    for key, hf_name in MTP_LAYERS[name].items():
        shape = stored.shapes[f"mtp.layers.0.{key}"]
        assert torch.equal(as_torch(stored.read_region(f"mtp.layers.0.{key}", (0,) * len(shape), shape)), tensors[layer + hf_name]), key


@pytest.mark.parametrize("name", MODELS)
def test_the_export_is_bit_exact(name, converted, tmp_path):
    hf, mcore = converted(name)
    convert_mcore_to_hf(mcore, tmp_path / "back", hf_config_dir=hf)
    original, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    written, read = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", hf))
    for field in FIELDS[name]:
        assert written[field] == read[field], field
