"""The cases of the GPU evidence: every family mconvert converts, each at the four-GPU layouts its shape allows.

A family is one line of FAMILIES (and so is a model type that a family reads by config rules of its own, as the
deepseek family reads GLM-4.7-Flash's): a real config (mconvert/configs) shrunk by mconvert.synthetic (hidden 64, 4 heads,
8 experts, vocabulary 1000), random weights at std 0.1, and what its runs need beyond that. A layout it cannot take
is named in `skipped` with the reason, and the tests show it skipped with that reason. Imported at collection: no
torch, no transformers, no megatron here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; megatron-core's default is tp

    @property
    def world(self) -> int:
        """Ranks the layout takes (megatron-core's smallest world for it: mconvert.verify.distributed.ParallelLayout)."""
        return math.lcm(self.tp, (self.tp if self.etp is None else self.etp) * self.ep) * self.pp

    def flags(self) -> list[str]:
        """mconvert's flags for the layout (hf-to-mcore and verify take the same)."""
        sizes = {"--tp": self.tp, "--pp": self.pp, "--ep": self.ep, "--etp": self.etp}
        return [word for flag, size in sizes.items() if size is not None for word in (flag, str(size))]


# The layouts of four GPUs, and of eight (issue 58: the layouts large MoE and dense models train at). Each takes all
# its world's ranks: verify and Megatron-LM's ranks run one layout a world.
LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("tp2pp2", tp=2, pp=2),
        Layout("tp2ep2", tp=2, ep=2),  # the experts split over TP too (ETP = TP = 2)
        Layout("ep4", ep=4),
        # Experts with biases: megatron-core takes them at ETP 1 only, where TP 2 x EP 2 is a world of 2 ranks.
        Layout("tp2pp2etp1", tp=2, pp=2, etp=1),
        Layout("tp2ep4etp1", tp=2, ep=4, etp=1),
        Layout("ep8", ep=8),
        Layout("tp8", tp=8),
        Layout("tp2ep4", tp=2, ep=4),  # ETP = TP = 2: a world of 8
        Layout("tp4ep2", tp=4, ep=2),  # ETP = TP = 4: a world of 8
        Layout("tp1"),  # the training test's one GPU
    )
}
# The layout of the training test: Megatron-LM's pretrain on one GPU (scripts/gpu/gpu_train.py), unless a family
# names another.
TRAINING_LAYOUT = "tp1"

BIASED_EXPERTS = "biased experts: megatron-core takes them at ETP 1 only"
# A dense model: no experts to place.
DENSE = {"layouts": ("tp2pp2",), "skipped": {"tp2ep2": "dense: no experts", "ep4": "dense: no experts"}}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # mconvert's family name (mconvert.mappings.FAMILIES), or the case's where `family` names it
    config: str  # a real config in mconvert/configs
    # mconvert's family name where `name` is not one: a model type the family reads by config rules of its own
    # (GLM-4.7-Flash in deepseek's), or a second model of it (Nemotron 3 Super's latent MoE beside Nano's).
    family: str = ""
    layers: int = 2
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # config fields after shrinking
    # The text-only checkpoint of an image-text config (its text_config as its own model).
    text_only: bool = False
    model_class: str = "gpt"  # hf-to-mcore's --model-class
    layouts: tuple[str, ...] = ("tp2pp2", "tp2ep2", "ep4")
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # layout: why not
    # Flags added to Megatron-LM's runs (the load and the training), as megatron_args.sh advises them.
    megatron_flags: tuple[str, ...] = ()
    # scripts/gpu/gpu_train.py's options for the training test.
    train_options: tuple[str, ...] = ()
    # Its layers run Triton kernels (flash-linear-attention's, mamba_ssm's) that every process compiles anew: its
    # work is started first, so that the longest runs are not the last.
    compiles_kernels: bool = False
    # Megatron-LM's logits may differ from transformers' by ATOL + logit_rtol x the largest logit (tests/gpu/test_layouts.py).
    logit_rtol: float = 1e-4
    # transformers' reference runs on the GPU, where Megatron-LM runs, not on the CPU: its own logits depend on the
    # device. DeepSeek-V3.2's indexer keeps 32 of up to 160 tokens, and transformers' fp32 logits on an H200 and on the
    # CPU part by up to 1.94 at 24 of 320 positions (other tokens kept), while Megatron-LM's on the H200 stay within
    # 4.6e-6 of transformers' there (4 x H200, 2026-11-27, every layout).
    reference_on_gpu: bool = False
    # The training test's layout (scripts/gpu/gpu_train.py on its world's GPUs), or None: no training test.
    training: str | None = TRAINING_LAYOUT
    # The HF model holds the multi-token prediction layers its config names (mconvert.synthetic.add_mtp_layers).
    mtp: bool = False
    # tests/gpu/test_vllm.py: config fields of its vLLM case (after `overrides`), where vLLM's kernels take fewer
    # shapes than mconvert's; and the largest difference it allows between vLLM's bf16 logprobs of its greedy tokens
    # and transformers' fp32 ones (None: the test's LOGPROB).
    vllm_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    vllm_logprob: float | None = None


# Gated delta-net: megatron-core's layers import flash-linear-attention (scripts/gpu/run_gpu_tests.sh installs it, and
# mamba_ssm for Nemotron-H). Megatron-LM runs its PyTorch delta rule under --deterministic-mode, which megatron_args.sh
# asks for on Hopper (fla refuses the backward there); verify runs the PyTorch rule on both sides (fla's kernels, which
# transformers and megatron-core call differently, parted by enough to flip Qwen3-Next's MoE routing: KL 2.5e-3 over
# 64 tokens on 4 x H200).
# Two implementations of the chunked delta rule, both in fp32, part further over a long prompt than attention does:
# measured on CPU ranks (MCONVERT_GPU_TESTS_DEVICE=cpu, 160 tokens), 1e-5 to 3.5e-3 of Qwen3-Next's largest logit 8.1
# (4.3e-4 of it; attention-only families stay under 6e-6, 1e-6 of it), while mconvert verify's prompts (up to 64
# tokens, one chunk) give KL 2.5e-10.
DELTA_NET = {"megatron_flags": ("--deterministic-mode",), "compiles_kernels": True, "logit_rtol": 1e-3}

# Mamba-2: mamba_ssm's Triton chunked scan (megatron-core's, on the GPU) against transformers' PyTorch scan on the CPU.
# Over the 160-token prompt, past the 128-token chunk, they part by 2.2e-3 with the largest logit about 4.5 (4.9e-4 of
# it; measured on 4 x H200, 2026-11-27, both Nemotron-H cases, at every layout alike), while mconvert verify's prompts
# (up to 64 tokens, one chunk) give KL 2.3e-10 and the training test's step losses agree to 4.2e-7.
MAMBA = {"compiles_kernels": True, "logit_rtol": 1e-3, "megatron_flags": ("--disable-mamba-mem-eff-path",),
         "train_options": ("--model-class", "hybrid")}

GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]

# YaRN's fused MLA rope (megatron-core's Triton kernel, which Megatron-LM runs by default) takes head dims of powers of
# two, as the released models have (128); the shrunk value head's 12 would stop it.
MLA_ROPE_FUSION = {"v_head_dim": 16}

# vLLM 0.25.0's MLA backends take DeepSeek-V3's latent head only: MLACommonBackend.get_supported_head_sizes() is
# [320, 576] (kv_lora_rank + qk_rope_head_dim; FlashAttention MLA, vLLM's choice on Hopper, and FlashMLA inherit it),
# so the shrunk 24 + 8 = 32 was refused. DeepSeek-V3's released attention dims, the rest of the model shrunk.
VLLM_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}

# vLLM 0.25.0's delta-net Triton kernels failed to compile for the shrunk key and value heads of 16 and 24 ("Mismatched
# type for mask_2d": blocks of 16 and 32, 4 x H200); the released models' heads are 128 wide, keys and values alike.
VLLM_DELTA_NET = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}

# vLLM's multimodal rope asserts that the sections cover the rotated half of a head (transformers' text positions, the
# same in all three sections, do not mind): the shrunk Qwen3.5's 32-wide heads rotate a quarter, 8 dims; the shrunk
# Qwen3-VL's 16-wide heads all of theirs.
QWEN3_5_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                    "mrope_interleaved": True, "mrope_section": [2, 1, 1]}}
QWEN3_VL_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000, "mrope_interleaved": True,
                                     "mrope_section": [4, 2, 2]}}

# Qwen3-MoE in vLLM: bf16 router logits (transformers' fp32) meet near-ties between experts' scores, and a position
# whose top-k experts differ gets another mixture: measured on 2 x H200 (2026-11-27), vLLM's tokens within 0.037 of
# transformers' best, their logprobs parted by 0.34 (TP 1) and 0.37 (TP 2); the fault (layer 0's MLP negated) by 21.9.
# 0.5 keeps the fault 40 times past the limit; the dense families keep 0.25. DeepSeek-V3's router (bf16 in vLLM, group-
# limited top-k) takes the same limit for the same reason: measured then (2 x H200, 2026-11-27), its logprobs parted by
# 0.18 and one token trailed transformers' best by 0.35 (a near-tie that routing flipped), the fault by 10.1. Both the
# logprob difference and the trailing gap of an MoE family are held to it; the other MoE families take it for the same
# reason, before their own first measurement.
MOE_ROUTING_LOGPROB = 0.5

FAMILIES = [
    Family("llama", "llama-3.1-8b", **DENSE),
    Family("qwen2", "qwen2.5-7b-instruct", **DENSE),
    Family("qwen3", "qwen3-8b", **DENSE),
    Family("qwen2_moe", "qwen1.5-moe-a2.7b", vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("qwen3_moe", "qwen3-30b-a3b", vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("mixtral", "mixtral-8x7b-v0.1", vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("deepseek", "deepseek-v3", overrides=MLA_ROPE_FUSION, vllm_overrides=VLLM_MLA,
           vllm_logprob=MOE_ROUTING_LOGPROB),
    # Kimi-K2.5's language model (its vision tower is left out, and copied back by the export).
    Family("kimi_k25", "kimi-k2.5", overrides=MLA_ROPE_FUSION, vllm_overrides=VLLM_MLA, vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("glm4_moe", "glm-4.5-air", vllm_logprob=MOE_ROUTING_LOGPROB),
    # Its indexer keeps 32 of up to 160 tokens, and ties in its scores fall by device: the reference on the GPU.
    Family("deepseek_v32", "deepseek-v3.2", reference_on_gpu=True),
    Family("gpt_oss", "gpt-oss-20b", overrides={"sliding_window": 32}, layouts=("tp2pp2etp1", "tp2ep4etp1", "ep4"),
           skipped={"tp2pp2": BIASED_EXPERTS + " (tp2pp2etp1 instead)", "tp2ep2": BIASED_EXPERTS + " (tp2ep4etp1 instead)"}),
    Family("qwen3_next", "qwen3-next-80b-a3b-instruct", layers=4, vllm_overrides=VLLM_DELTA_NET, vllm_logprob=MOE_ROUTING_LOGPROB,
           **DELTA_NET),
    Family("qwen3_5", "qwen3.5-0.8b", layers=4, vllm_overrides={**VLLM_DELTA_NET, **QWEN3_5_ROPE}, **DENSE, **DELTA_NET),
    Family("qwen3_5_text", "qwen3.5-35b-a3b", layers=4, text_only=True, **DELTA_NET),
    # Qwen3-VL's language model (its vision tower left out of Megatron-LM's layout and copied back by the export).
    Family("qwen3_vl", "qwen3-vl-8b-instruct", vllm_overrides=QWEN3_VL_ROPE, **DENSE),
    # transformers 5.17 (the GPU machines') turns rope on the head's dims that partial_rotary_factor says, not rotary_dim.
    Family("minimax_m2", "minimax-m2.7", overrides={"partial_rotary_factor": 0.5}, vllm_logprob=MOE_ROUTING_LOGPROB),
    # Rope on interleaved pairs: the printed flags keep Transformer Engine's fused rope (TE >= 2.3 rotates pairs).
    Family("ernie4_5", "ernie-4.5-0.3b-pt", **DENSE),
    Family("olmoe", "olmoe-1b-7b-0924", vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("glm4_moe_lite", "glm-4.7-flash", family="deepseek", vllm_overrides=VLLM_MLA, vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("dots1", "dots.llm1.inst", family="glm4_moe", overrides={"sliding_window": 32, "max_window_layers": 1}, vllm_logprob=MOE_ROUTING_LOGPROB),
    Family("hy_v3", "hy3-preview", vllm_logprob=MOE_ROUTING_LOGPROB),
    # Norms after the sublayers (mconvert's --spec); OLMo 3 from OLMo 2's config: windows on three layers in four,
    # grouped-query attention.
    Family("olmo2", "olmo-2-1124-7b-instruct", **DENSE),
    Family("olmo3", "olmo-2-1124-7b-instruct", layers=4, overrides={
        "model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "sliding_window": 32, "num_key_value_heads": 2}, **DENSE),
    # Norms before and after the sublayers, a tanh-GELU GeGLU and the sliding-window layers' own rope (mconvert's
    # --spec), the embedding multiplier and attention scale as MuP's flags; windows on three layers in four. The
    # image-text checkpoint without its 4B's linear rope scaling, which pretrain_gpt.py does not pass GPTModel
    # (megatron_args.sh says so; tests/megatron_lm/test_gemma3.py holds megatron-core's logits with it).
    Family("gemma3_text", "gemma-3-1b-pt", layers=4, overrides={"sliding_window": 32, "layer_types": GEMMA3_LAYER_TYPES}, **DENSE),
    Family("gemma3", "gemma-3-4b-it", layers=4, overrides={
        "sliding_window": 32, "layer_types": GEMMA3_LAYER_TYPES, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000}, "sliding_attention": {"rope_type": "default", "rope_theta": 10_000}}},
        **DENSE),
    # Without causal_conv1d (a CUDA build) megatron-core's fused Mamba path cannot run: its other path, the same function.
    Family("nemotron_h", "nemotron-3-nano-30b-a3b", layers=6, model_class="hybrid", vllm_logprob=MOE_ROUTING_LOGPROB, **MAMBA),
    # Latent MoE: megatron-core's latent projections are Transformer Engine's (a stand-in on CPU ranks).
    Family("nemotron_h_latent", "nemotron-3-super-120b-a12b", layers=4, family="nemotron_h", model_class="hybrid",
           overrides={"hybrid_override_pattern": "ME*E"}, vllm_logprob=MOE_ROUTING_LOGPROB, **MAMBA),
]


def real_widths(config: str, *keys: str) -> dict[str, Any]:
    """The real config's values of `keys` (those it has), set over the shrunk ones: the widths a user trains at."""
    real = json.loads((Path(__file__).resolve().parents[2] / "mconvert" / "configs" / f"{config}.json").read_text())
    return {key: real[key] for key in keys if key in real}


WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "moe_intermediate_size", "num_experts", "num_experts_per_tok")
# Eight GPUs (issue 58): the layouts people train large models at, cases of their own (not every family at eight).
EIGHT_GPUS = [
    # Qwen3-30B-A3B's real width (128 experts, 8 a token, 32 heads in 4 groups), its first 2 layers, at EP 8, and
    # Megatron-LM's training at EP 8.
    Family("qwen3_30b_ep8", "qwen3-30b-a3b", family="qwen3_moe", overrides=real_widths("qwen3-30b-a3b", *WIDTHS),
           layouts=("ep8",), training="ep8"),
    # A Llama-3.1-70B-width cut (hidden 8192, 64 heads in 8 groups, MLP 28672; its config is 8B's with those widths),
    # 2 layers, at TP 8.
    Family("llama_70b_tp8", "llama-3.1-8b", family="llama", overrides={
        "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8},
        layouts=("tp8",), training=None),
    # DeepSeek-V3 (MLA, MoE, its dense first layers) with its multi-token prediction layer, at TP 2 x EP 4 and
    # TP 4 x EP 2.
    Family("deepseek_v3_mtp", "deepseek-v3", family="deepseek", overrides=MLA_ROPE_FUSION, mtp=True,
           layouts=("tp2ep4", "tp4ep2"), training=None),
]
FAMILY = {family.name: family for family in FAMILIES + EIGHT_GPUS}

# Layouts shown for every family, the skipped ones with their reason.
SHOWN_LAYOUTS = ("tp2pp2", "tp2ep2", "ep4")


def layout_cases() -> list[tuple[str, str, str | None]]:
    """(family, layout, why skipped or None) for every family at every layout it takes or is shown skipped at, then
    the eight-GPU cases at theirs."""
    cases = []
    for family in FAMILIES:
        for name in dict.fromkeys((*SHOWN_LAYOUTS, *family.layouts)):
            if name in family.layouts:
                cases.append((family.name, name, None))
            else:
                cases.append((family.name, name, family.skipped[name]))
    return cases + [(family.name, name, None) for family in EIGHT_GPUS for name in family.layouts]


def training_cases() -> list[tuple[str, str]]:
    """(family, layout) of every training test."""
    return [(family.name, family.training) for family in FAMILIES + EIGHT_GPUS if family.training]


def case_id(family: str, layout: str) -> str:
    return f"{family}-{layout}"
