"""Comparing two models' logits: the metrics, the thresholds that decide pass or fail, the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Thresholds:
    """Pass when, for a prompt: cosine >= min_cosine, mean KL <= max_kl, top-1 agreement >= min_top1.

    fp32 on both sides differs only by summation order (different kernels, TP reductions): fixed limits,
    orders of magnitude above that and below what a conversion error (a swapped, transposed or mis-interleaved
    tensor) gives. bf16 rounds every activation, which compounds over layers and, on nearly flat next-token
    distributions (random-init models), flips top-1 choices: no fixed limit separates that from a small
    error. So in bf16 the limits are calibrated per prompt on the HF model's own bf16 error (its bf16 logits
    against its fp32 logits, the reference): Megatron in bf16 may be BF16_MARGIN times further off, no more.
    """

    min_cosine: float
    max_kl: float
    min_top1: float


FP32 = Thresholds(min_cosine=0.99999, max_kl=1e-5, min_top1=0.99)
# Relative L2 difference of a decoder layer's output above which, in fp32, the layer counts as diverged.
FP32_HIDDEN_REL = 1e-3
BF16_MARGIN = 4.0


def bf16_limit(hf_bf16_error: float) -> float:
    """How far Megatron in bf16 may be off where the HF model's own bf16 run is `hf_bf16_error` off."""
    return BF16_MARGIN * hf_bf16_error + 1e-6


def bf16_thresholds(floor: PromptMetrics) -> Thresholds:
    """Limits for a prompt whose HF bf16 run differs from the fp32 reference by `floor`."""
    return Thresholds(
        min_cosine=1.0 - bf16_limit(1.0 - floor.cosine),
        max_kl=bf16_limit(floor.kl),
        # Near-ties flip either way in bf16: allow 10% of the tokens, and at least two, beyond HF's own flips.
        min_top1=floor.top1_agreement - max(0.1, 2.0 / floor.tokens),
    )


@dataclass(frozen=True)
class PromptMetrics:
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    cosine: float
    kl: float  # mean over positions of KL(reference || candidate) of the next-token distributions
    top1_agreement: float
    top5_overlap: float

    def passes(self, limits: Thresholds) -> bool:
        return self.cosine >= limits.min_cosine and self.kl <= limits.max_kl and self.top1_agreement >= limits.min_top1


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> PromptMetrics:
    """Metrics of one prompt's logits [seq, vocab] (same real vocabulary on both sides)."""
    reference, candidate = reference.double(), candidate.double()
    diff = (reference - candidate).abs()
    log_p, log_q = reference.log_softmax(-1), candidate.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    top5_ref, top5_cand = reference.topk(5, dim=-1).indices, candidate.topk(5, dim=-1).indices
    overlap = (top5_ref[:, :, None] == top5_cand[:, None, :]).any(-1).double().mean()
    return PromptMetrics(
        tokens=reference.shape[0],
        max_abs_diff=diff.max().item(),
        mean_abs_diff=diff.mean().item(),
        cosine=torch.nn.functional.cosine_similarity(reference.flatten(), candidate.flatten(), dim=0).item(),
        kl=max(kl.item(), 0.0),
        top1_agreement=(top5_ref[:, 0] == top5_cand[:, 0]).double().mean().item(),
        top5_overlap=overlap.item(),
    )


def hidden_rel_errors(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> list[float]:
    """Relative L2 difference of each decoder layer's output."""
    return [
        ((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-12)).item()
        for a, b in zip(reference, candidate)
    ]


@dataclass(frozen=True)
class Report:
    passed: bool
    dtype: str
    prompts: list[PromptMetrics]
    thresholds: list[Thresholds]  # per prompt
    # bf16 only: the HF model's own bf16 logits against its fp32 ones, per prompt (what the limits rest on).
    hf_bf16_error: list[PromptMetrics] | None
    first_diverging_layer: int | None
    seconds: dict[str, float]
    # The layer spec megatron-core's GPTModel was built with: "te" (Transformer Engine) or "local".
    spec: str
    # What the comparison covered or left out, said with the result.
    notes: list[str]

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"megatron-core layer spec: {self.spec}",
            f"{'prompt':>6} {'tokens':>6} {'max|d|':>10} {'mean|d|':>10} {'cosine':>10} {'KL':>10} {'top1':>6} {'top5':>6}  result"
        ]
        for index, (m, limits) in enumerate(zip(self.prompts, self.thresholds)):
            result = "pass" if m.passes(limits) else "FAIL"
            lines.append(
                f"{index:>6} {m.tokens:>6} {m.max_abs_diff:>10.3g} {m.mean_abs_diff:>10.3g} {m.cosine:>10.7f} "
                f"{m.kl:>10.3g} {m.top1_agreement:>6.3f} {m.top5_overlap:>6.3f}  {result}"
            )
        if self.hf_bf16_error is None:
            t = self.thresholds[0]
            lines.append(f"thresholds (fp32): cosine >= {t.min_cosine}, KL <= {t.max_kl:g}, top-1 >= {t.min_top1}")
        else:
            lines.append(
                f"reference: HF in fp32. Thresholds (bf16), per prompt: {BF16_MARGIN:g} x the HF model's own bf16 "
                "error, which is:"
            )
            for index, (floor, t) in enumerate(zip(self.hf_bf16_error, self.thresholds)):
                lines.append(
                    f"{index:>6} HF bf16: cosine {floor.cosine:.7f} KL {floor.kl:.3g} top-1 {floor.top1_agreement:.3f}"
                    f" -> cosine >= {t.min_cosine:.7f}, KL <= {t.max_kl:.3g}, top-1 >= {t.min_top1:.3f}"
                )
        if self.first_diverging_layer is not None:
            lines.append(f"hidden states first diverge at decoder layer {self.first_diverging_layer}")
        lines += [f"note: {note}" for note in self.notes]
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)
