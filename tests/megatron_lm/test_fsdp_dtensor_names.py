"""`hf-to-mcore --format fsdp_dtensor` judged by Megatron-LM 0.19.2's model: every tensor of the model that
Megatron-LM's builder makes (its own module names, under the local spec that runs on CPU) is in the checkpoint
under the name Megatron-FSDP's save gives it (`model.module.<name>`, a SwiGLU fc1 as `_w` then `_v` halves),
holding what the same model loads from the torch_dist conversion. A Megatron-FSDP load skips names it does not
find without a word, so the names are the whole question. Megatron-FSDP itself needs a GPU: its load and
training steps from such a conversion are in docs/verification.md (scripts/gpu/gpu_session.sh fsdp)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("megatron.training")

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.formats.dcp import DCPCheckpoint  # noqa: E402
from mconvert.synthetic import write_word_tokenizer  # noqa: E402
from mconvert.verify.distributed import run_ranks  # noqa: E402
from mconvert.verify.megatron_lm import CPU_FLAGS, RUN_FLAGS, load_as_megatron_lm, script_arrays  # noqa: E402

# Megatron-FSDP's SwiGLU fc1 tensors (megatron/core/transformer/fsdp_dtensor_checkpoint.py, is_swiglu_key).
SWIGLU = re.compile(
    r"\.mlp\.linear_fc1\.(weight|bias)$|\.mlp\.experts\.linear_fc1\.(weight|bias)\d+$"
    r"|\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$|\.mlp\.shared_experts\.linear_fc1\.(weight|bias)$"
)
MODELS = {
    # Dense with GQA; GLM-4.5's MoE (shared expert, routing bias). The multi-token prediction layer's names
    # (mtp_model_layer) are judged on the GPU: the model this CPU harness builds has none.
    "llama3.1": ("llama-3.1-8b", {}),
    "glm4.5-air": ("glm-4.5-air", {}),
}


def model_tensors(argv: list[str]) -> dict[str, torch.Tensor]:
    """In a rank: the tensors of the model Megatron-LM builds and loads, by its modules' names."""
    model, _ = load_as_megatron_lm(argv)
    return {name: t.clone() for name, t in model[0].state_dict().items() if isinstance(t, torch.Tensor) and not name.endswith("_extra_state")}


@pytest.mark.parametrize("name", MODELS)
def test_every_tensor_of_megatron_lms_model_is_where_megatron_fsdp_reads_it(name, hf_model_factory, tmp_path):
    config, overrides = MODELS[name]
    hf = hf_model_factory(config, **overrides)
    if not (hf / "tokenizer.json").exists():
        write_word_tokenizer(hf, 1000)
    torch_dist, fsdp = tmp_path / "torch_dist", tmp_path / "fsdp"
    convert_hf_to_mcore(hf, torch_dist)
    # The local spec's experts are SequentialMLP's (local_experts.<j>); under TE, TEGroupedMLP's (weight<j>).
    convert_hf_to_mcore(hf, fsdp, ckpt_format="fsdp_dtensor", transformer_impl="local")
    expected = run_ranks(model_tensors, script_arrays(torch_dist, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS)
    stored = DCPCheckpoint(fsdp / "iter_0000000")

    def read(key: str) -> torch.Tensor:
        shape = stored.shapes[key]
        return stored.read_region(key, (0,) * len(shape), shape)

    assert any(SWIGLU.search(n) for n in expected)
    for module_name, tensor in expected.items():
        key = "model.module." + re.sub(r"^(module\.)+", "", module_name)
        held = torch.cat([read(key + "_w"), read(key + "_v")]) if SWIGLU.search(key) else read(key)
        assert torch.equal(held.to(tensor.dtype), tensor), key
