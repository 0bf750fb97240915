"""`mconvert verify`: run the HF model and the converted Megatron-Core model on the same prompts and decide,
by the thresholds in compare.py, whether they agree.

The Megatron side is built from the checkpoint's own stored args (not from the HF config, so a wrong stored
arg is caught), loaded with megatron-core's dist_checkpointing at the requested TP/PP/EP, on GPUs through
NCCL or on CPU gloo ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mconvert.converters.fsdp_saves import FSDP_FORMATS
from mconvert.converters.mcore_sources import open_megatron_checkpoint
from mconvert.dependencies import MAMBA, MAMBA_INSTALL, VERIFY, VERIFY_INSTALL, require
from mconvert.errors import ConversionError
from mconvert.formats.hf_checkpoint import read_hf_config
from mconvert.mappings import ModelSpec, get_mapping
from mconvert.mcore import hybrid
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.megatron_lm.hybrid_args import gpt_view
from mconvert.verify.compare import (
    FP32,
    FP32_HIDDEN_REL,
    Report,
    bf16_limit,
    bf16_thresholds,
    compare_logits,
    hidden_rel_errors,
)
from mconvert.verify.hf_side import Outputs, hf_outputs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# `--spec` names and the transformer_impl Megatron-LM builds each with.
SPECS = {"te": "transformer_engine", "local": "local"}
# Arguments that define the network; a difference in any of them means the two sides are different models.
ARCHITECTURE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "vocab_size", "rotary_base", "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
    "layernorm_epsilon", "norm_epsilon", "window_size", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
)


class ArchitectureMismatch(Exception):
    """The checkpoint's stored args describe another model than the HF config.json."""


def builtin_prompts(vocab_size: int) -> list[torch.Tensor]:
    """Token ids that need no tokenizer: fixed pseudo-random sequences of a few lengths over the vocabulary."""
    generator = torch.Generator().manual_seed(20261122)
    return [torch.randint(0, vocab_size, (length,), generator=generator) for length in (7, 16, 32, 64)]


# The chunk of megatron-core's Mamba scan (MambaMixer's chunk_size, which Megatron-LM does not set).
MAMBA_CHUNK = 128

# What a tokenizer saved by transformers leaves in a model directory (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")


def text_prompts(path: Path, hf_dir: Path) -> list[torch.Tensor]:
    import transformers

    # transformers 5 makes an empty tokenizer for a directory that has none: look for its files first.
    if not any((hf_dir / name).exists() for name in TOKENIZER_FILES):
        raise ConversionError(f"--prompts needs a tokenizer in {hf_dir} (none of {', '.join(TOKENIZER_FILES)})")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ConversionError(f"--prompts {path}: no prompts in the file")
    prompts = [torch.tensor(tokenizer(line)["input_ids"], dtype=torch.long) for line in lines]
    empty = [number for number, prompt in enumerate(prompts, 1) if not len(prompt)]
    if empty:
        raise ConversionError(f"--prompts {path}: prompt {empty[0]} gives no tokens")
    return prompts


def check_architecture(hf_dir: Path, stored: argparse.Namespace) -> ModelSpec:
    """The HF model's spec, when the checkpoint's args describe the same architecture."""
    _, spec = get_mapping(read_hf_config(hf_dir, "--hf"), source=str(hf_dir / "config.json"))
    expected = vars(megatron_args(spec, Parallelism(), spec.dtype, "transformer_engine"))
    differences = [
        f"{name}: checkpoint {getattr(stored, name, None)!r}, HF {expected.get(name)!r}"
        for name in ARCHITECTURE_ARGS
        # Checkpoints saved by Megatron training may leave some out; what they do store must agree.
        if getattr(stored, name, None) is not None and getattr(stored, name) != expected.get(name)
    ]
    if differences:
        raise ArchitectureMismatch("; ".join(differences))
    return spec


def require_hybrid_model(mcore_dir: Path) -> None:
    """HybridModel, from megatron-core 0.19 on (before it, MambaModel keyed its layers otherwise)."""
    import importlib.util

    from mconvert.verify.megatron_model import MEGATRON_CORE_VERSION

    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        raise ConversionError(
            f"--mcore {mcore_dir}: a HybridModel checkpoint, and megatron-core {MEGATRON_CORE_VERSION} has no HybridModel: "
            "verify with megatron-core 0.19 or later"
        )


def resolve_spec(spec: str | None) -> str:
    """The layer spec to verify with: the one asked for, else Transformer Engine's when it imports (what
    Megatron-LM trains with by default), else the local one."""
    from mconvert.verify.megatron_model import HAVE_TRANSFORMER_ENGINE

    if spec is None:
        return "te" if HAVE_TRANSFORMER_ENGINE else "local"
    if spec == "te" and not HAVE_TRANSFORMER_ENGINE:
        raise ConversionError("--spec te: transformer_engine is not installed (it does not import); use --spec local")
    return spec


def megatron_outputs(
    ckpt_dir: str, prompts: list[torch.Tensor], vocab_size: int, dtype: torch.dtype, device: str, spec: str,
    pipeline: dict[str, Any],
) -> Outputs:
    """Runs in every rank: load the checkpoint into megatron-core's GPTModel (or HybridModel), its layers split over
    the pipeline stages as `pipeline` (Megatron-LM's args) says, and run the prompts."""
    from mconvert.verify.megatron_side import forward_logits_and_hidden_states, load_model

    args = read_args(iteration_dir(Path(ckpt_dir)))
    vars(args).update(pipeline)  # this run's split, not necessarily the one the checkpoint was written for
    model = load_model(ckpt_dir, args, dtype, device, transformer_impl=SPECS[spec])
    outputs = Outputs([], [])
    for tokens in prompts:
        logits, hidden = forward_logits_and_hidden_states(model, tokens[None])
        outputs.logits.append(logits[0, :, :vocab_size].float())  # padding rows cut
        outputs.hidden_states.append([h[0] for h in hidden])
    return outputs


@dataclass(frozen=True)
class VerifyRequest:
    hf_dir: Path
    mcore_dir: Path
    parallelism: Parallelism
    device: str = "cpu"
    dtype: str = "fp32"
    prompts_file: Path | None = None
    timeout_s: float = 1800.0
    spec: str | None = None  # "te" or "local"; None: "te" when Transformer Engine imports


def verify(request: VerifyRequest) -> Report:
    """Compare the two models; raises ConversionError for unusable input, ArchitectureMismatch for
    different models; MissingDependency (a ConversionError) without megatron-core or transformers."""
    require(VERIFY, "mconvert verify", VERIFY_INSTALL)
    from mconvert.verify.distributed import ParallelLayout, run_ranks

    par = request.parallelism
    spec = resolve_spec(request.spec)
    if spec == "te" and request.device != "cuda":
        raise ConversionError("--spec te needs --device cuda (Transformer Engine runs on GPUs only)")
    if spec == "te" and request.dtype == "fp32":
        # Transformer Engine computes fp32 GEMMs in TF32 unless told not to (3e-3 to 2e-2 of the logit scale
        # measured on H200, against 2e-5 without): an fp32 comparison would measure TF32. Read by cuBLAS when
        # the rank processes, spawned after this, start.
        os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    if request.device == "cuda":
        if not torch.cuda.is_available():
            raise ConversionError("--device cuda: no GPU is visible")
        world = ParallelLayout(tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp).world_size
        if world > torch.cuda.device_count():
            raise ConversionError(f"--tp/--pp/--ep need {world} GPUs, {torch.cuda.device_count()} visible")
    if not (request.hf_dir / "config.json").exists():
        raise ConversionError(f"--hf {request.hf_dir}: no config.json")
    if open_megatron_checkpoint(request.mcore_dir).format in FSDP_FORMATS:
        raise ConversionError(
            f"--mcore {request.mcore_dir}: an FSDP save (fsdp_dtensor or torch_dcp), which megatron-core's models do not "
            "load outside an FSDP run: verify a torch_dist conversion of the same HF model (the same tensors), or compare "
            "mcore-to-hf's export of this one with the HF model"
        )
    stored = read_args(iteration_dir(request.mcore_dir))
    pattern = getattr(stored, "hybrid_layer_pattern", None)
    if getattr(stored, "mamba_num_heads", None):
        require(MAMBA, "mconvert verify of Mamba layers", MAMBA_INSTALL)
    if pattern:
        require_hybrid_model(request.mcore_dir)
        par = dataclasses.replace(par, model_class="hybrid")  # the run's layout for a HybridModel checkpoint
    # A HybridModel checkpoint's args are compared as the GPT model's they were made from.
    stored_gpt = gpt_view(stored, f"--mcore {request.mcore_dir}")
    hf_spec = check_architecture(request.hf_dir, stored_gpt)
    from mconvert.verify.megatron_model import require_output_gate_above_query_groups

    require_output_gate_above_query_groups(stored, par.tp)
    # The rules hf-to-mcore checks a layout by, for the MTP layers the checkpoint holds (--no-mtp leaves them out).
    par.validate(dataclasses.replace(hf_spec, mtp_layers=getattr(stored_gpt, "mtp_num_layers", None) or 0))
    pipeline = par.pipeline.args(par.pp)
    if pipeline["virtual_pipeline_model_parallel_size"] is not None:
        raise ConversionError("--pipeline-model-parallel-layout: verify runs one stage a rank (no virtual pipeline stages)")
    if pattern:
        # HybridModel's stages are its pattern's `|`, placed anew for this run's split.
        pipeline = {"hybrid_layer_pattern": hybrid.restaged(
            pattern, par.pipeline.stage_layers(par.pp, hf_spec.num_layers), hybrid.blocks_per_layer(hf_spec)
        )}
    vocab_size = hf_spec.vocab_size
    prompts = (
        text_prompts(request.prompts_file, request.hf_dir)
        if request.prompts_file
        else builtin_prompts(vocab_size)
    )
    notes = []
    window = stored.window_size[0] + 1 if getattr(stored, "window_size", None) else None
    if window is not None and max(len(prompt) for prompt in prompts) > window:
        # Within the window both sides attend to every earlier token: the weights are compared, not two
        # implementations of the window (tests/test_dense_megatron.py checks the window on CPU).
        prompts = [prompt[:window] for prompt in prompts]
        notes.append(f"sliding window of {window} tokens: prompts cut to the window")
    elif window is not None:
        notes.append(f"sliding window of {window} tokens: every prompt is within it")
    top_k = getattr(stored, "dsa_indexer_topk", None) if getattr(stored, "experimental_attention_variant", None) == "dsa" else None
    if top_k is not None and max(len(prompt) for prompt in prompts) <= top_k:
        if request.prompts_file:
            notes.append(f"sparse attention keeps the best {top_k} tokens: every prompt is within them, so its indexer chooses none")
        else:
            # Only a prompt longer than the top-k makes the indexer choose: one of top-k + 64 tokens joins them.
            prompts.append(torch.randint(0, vocab_size, (top_k + 64,), generator=torch.Generator().manual_seed(top_k)))
            notes.append(f"sparse attention keeps the best {top_k} tokens: prompt {len(prompts) - 1} ({top_k + 64} tokens) makes its indexer choose")
    if getattr(stored, "mamba_num_heads", None) and not request.prompts_file:
        # megatron-core's Mamba layers scan in chunks of 128 tokens: a prompt of two makes the state pass between them.
        prompts.append(torch.randint(0, vocab_size, (MAMBA_CHUNK + 32,), generator=torch.Generator().manual_seed(MAMBA_CHUNK)))
        notes.append(f"Mamba layers scan in chunks of {MAMBA_CHUNK} tokens: prompt {len(prompts) - 1} ({MAMBA_CHUNK + 32} tokens) spans two")
    dtype = DTYPES[request.dtype]
    seconds = {}
    started = time.perf_counter()
    # The reference is the HF model in fp32; in bf16 its own bf16 run measures what bf16 alone costs.
    reference = hf_outputs(request.hf_dir, prompts, torch.float32, request.device)
    hf_bf16 = hf_outputs(request.hf_dir, prompts, dtype, request.device) if dtype != torch.float32 else None
    seconds["hf"] = time.perf_counter() - started
    started = time.perf_counter()
    candidate = run_ranks(
        megatron_outputs, str(request.mcore_dir), prompts, vocab_size, dtype, request.device, spec, pipeline,
        tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp, device=request.device, timeout_s=request.timeout_s,
    )
    seconds["megatron"] = time.perf_counter() - started
    return compare(reference, hf_bf16, candidate, request.dtype, seconds, spec, notes)


def compare(
    reference: Outputs, hf_bf16: Outputs | None, candidate: Outputs, dtype: str, seconds: dict[str, float], spec: str,
    notes: list[str],
) -> Report:
    """Pass or fail for Megatron's outputs (`candidate`) against the HF model's fp32 ones (`reference`), at the
    thresholds of compare.py: fixed in fp32, in bf16 (`hf_bf16`: the HF model's own bf16 run) calibrated per prompt on
    the HF model's own bf16 error."""
    metrics = [compare_logits(ref, cand) for ref, cand in zip(reference.logits, candidate.logits)]
    layer_errors = [hidden_rel_errors(ref, cand) for ref, cand in zip(reference.hidden_states, candidate.hidden_states)]
    if hf_bf16 is None:
        floors = None
        limits = [FP32] * len(metrics)
        layer_limits = [[FP32_HIDDEN_REL] * len(errors) for errors in layer_errors]
    else:
        floors = [compare_logits(ref, own) for ref, own in zip(reference.logits, hf_bf16.logits)]
        floor_layers = [hidden_rel_errors(ref, own) for ref, own in zip(reference.hidden_states, hf_bf16.hidden_states)]
        limits = [bf16_thresholds(floor) for floor in floors]
        layer_limits = [[bf16_limit(error) for error in errors] for errors in floor_layers]
    diverged = [
        next((layer for layer, (error, limit) in enumerate(zip(errors, bounds)) if error > limit), None)
        for errors, bounds in zip(layer_errors, layer_limits)
    ]
    first = min((layer for layer in diverged if layer is not None), default=None)
    passed = all(m.passes(limit) for m, limit in zip(metrics, limits))
    return Report(passed, dtype, metrics, limits, floors, first, seconds, spec, notes)
