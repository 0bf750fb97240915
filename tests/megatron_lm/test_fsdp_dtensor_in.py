"""`hf-to-mcore --format fsdp_dtensor` checked by Megatron-LM 0.19.2 on CPU: its parser takes MODEL_ARGS and LOAD_ARGS
as a Megatron-FSDP resumption, its check_checkpoint_args (which that resumption runs) accepts the stored args, and
every tensor of the model its builder makes (its own module names, under the local spec that runs on CPU) is in
the checkpoint under the name Megatron-FSDP reads (`model.module.<name>`, a SwiGLU fc1 as `_w` then `_v` halves),
holding what the same model loads from the torch_dist conversion, with its Adam step count beside it. Megatron-FSDP's
load is partial (LOAD_ARGS) and skips a name it does not find without a word, so the names are the whole question.
Megatron-FSDP itself needs a GPU: its training steps from such a conversion are in docs/verification.md."""

from __future__ import annotations

import os
import re

import pytest
import torch

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package: the Python 3.12 environment")

from mconvert.dtypes import as_torch
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.formats.dcp import DCPCheckpoint  # noqa: E402
from mconvert.mcore.parallelism import Parallelism  # noqa: E402
from mconvert.synthetic import write_word_tokenizer  # noqa: E402
from mconvert.verify.distributed import run_ranks  # noqa: E402
from mconvert.verify.megatron_lm import CPU_FLAGS, RUN_FLAGS, load_as_megatron_lm, parse_megatron_lm_args, script_arrays  # noqa: E402

SWIGLU = re.compile(
    r"\.mlp\.linear_fc1\.(weight|bias)$|\.mlp\.experts\.linear_fc1\.(weight|bias)\d+$"
    r"|\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$|\.mlp\.shared_experts\.linear_fc1\.(weight|bias)$"
)
MODELS = {
    # Dense with GQA; GLM-4.5's MoE (shared expert, routing bias). The multi-token prediction layer's names
    # (mtp_model_layer) are those of a real Megatron-FSDP save (tests/test_fsdp_dtensor_out.py).
    "llama3.1": ("llama-3.1-8b", Parallelism(tp=2)),
    "glm4.5-air": ("glm-4.5-air", Parallelism(tp=2, ep=2)),
    # megatron-core's HybridModel: each layer's attention and MLP layers of their own.
    "qwen3-hybrid": ("qwen3-8b", Parallelism(tp=2, model_class="hybrid")),
}


def test_megatron_lm_resumes_from_it_with_its_flags_and_stored_args(hf_model_factory, tmp_path):
    from megatron.training import checkpointing, global_vars

    hf = hf_model_factory("deepseek-v3")
    convert_hf_to_mcore(hf, tmp_path / "fsdp", parallelism=Parallelism(tp=2, ep=2), ckpt_format="fsdp_dtensor")
    args = parse_megatron_lm_args(script_arrays(tmp_path / "fsdp", "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS, world_size=4)
    # A resumption, its load partial: neither --finetune nor --no-load-optim (mconvert.megatron_lm.flags.load_flags).
    assert args.use_megatron_fsdp and args.ckpt_format == "fsdp_dtensor" and not args.strict_fsdp_dtensor_load
    assert not args.finetune and not args.no_load_optim and args.no_load_rng
    global_vars.set_args(args)
    checkpointing.set_checkpoint_version(3.0)
    stored = DCPCheckpoint(tmp_path / "fsdp" / "iter_0000000").read_object("args")
    checkpointing.check_checkpoint_args(stored)
    stored.hidden_size += 1  # injected: the check a resumption makes catches a model of another width
    with pytest.raises(AssertionError, match="hidden_size"):
        checkpointing.check_checkpoint_args(stored)


def model_tensors(argv: list[str]) -> dict[str, torch.Tensor]:
    """In a rank: the tensors of the model Megatron-LM builds and loads, by its modules' names."""
    model, _ = load_as_megatron_lm(argv)
    return {name: t.clone() for name, t in model[0].state_dict().items() if isinstance(t, torch.Tensor) and not name.endswith("_extra_state")}


@pytest.mark.parametrize("name", MODELS)
def test_every_tensor_of_megatron_lms_model_is_where_megatron_fsdp_reads_it(name, hf_model_factory, tmp_path):
    config, parallelism = MODELS[name]
    hf = hf_model_factory(config)
    if not (hf / "tokenizer.json").exists():
        write_word_tokenizer(hf, 1000)
    torch_dist, fsdp = tmp_path / "torch_dist", tmp_path / "fsdp"
    convert_hf_to_mcore(hf, torch_dist, parallelism=Parallelism(model_class=parallelism.model_class))
    # The local spec's experts are SequentialMLP's (local_experts.<j>); under TE, TEGroupedMLP's (weight<j>).
    convert_hf_to_mcore(hf, fsdp, parallelism=parallelism, ckpt_format="fsdp_dtensor", transformer_impl="local")
    expected = run_ranks(model_tensors, script_arrays(torch_dist, "MODEL_ARGS", "LOAD_ARGS") + RUN_FLAGS + CPU_FLAGS)
    stored = DCPCheckpoint(fsdp / "iter_0000000")

    def read(key: str) -> torch.Tensor:
        shape = stored.shapes[key]
        return as_torch(stored.read_region(key, (0,) * len(shape), shape))

    assert any(SWIGLU.search(n) for n in expected)
    for module_name, tensor in expected.items():
        name = re.sub(r"^(module\.)+", "", module_name)
        key = "model.module." + name
        held = torch.cat([read(key + "_w"), read(key + "_v")]) if SWIGLU.search(key) else read(key)
        assert torch.equal(held.to(tensor.dtype), tensor), key
        # Megatron-FSDP wraps the model twice, Float16Module once more in bf16 (mconvert.mcore.fsdp_dtensor).
        assert stored.read_object(f"optimizer.param_to_group_meta.module.module.module.{name}.step") == 0, name
