"""Comparing two models' logits: the metrics, the thresholds that decide pass or fail, the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Thresholds:
    """Pass when, for every prompt: cosine >= min_cosine, mean KL <= max_kl, top-1 agreement >= min_top1.

    fp32 on both sides differs only by summation order (different kernels, TP reductions); bf16 adds a
    rounding of every activation, which compounds over layers, hence the looser figures. A conversion error
    (a swapped, transposed or mis-interleaved tensor) moves these by orders of magnitude.
    """

    min_cosine: float
    max_kl: float
    min_top1: float
    # Relative L2 difference of a layer's output above which the layer counts as diverged.
    max_hidden_rel: float


THRESHOLDS = {
    "fp32": Thresholds(min_cosine=0.99999, max_kl=1e-5, min_top1=0.99, max_hidden_rel=1e-3),
    "bf16": Thresholds(min_cosine=0.995, max_kl=2e-2, min_top1=0.90, max_hidden_rel=5e-2),
}


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


def first_diverging_layer(reference: list[torch.Tensor], candidate: list[torch.Tensor], limit: float) -> int | None:
    """Index of the first decoder layer whose outputs differ by more than `limit` (relative L2), or None."""
    for index, (a, b) in enumerate(zip(reference, candidate)):
        a, b = a.double(), b.double()
        if ((a - b).norm() / b.norm().clamp_min(1e-12)).item() > limit:
            return index
    return None


@dataclass(frozen=True)
class Report:
    passed: bool
    dtype: str
    thresholds: Thresholds
    prompts: list[PromptMetrics]
    first_diverging_layer: int | None
    seconds: dict[str, float]

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        header = f"{'prompt':>6} {'tokens':>6} {'max|d|':>10} {'mean|d|':>10} {'cosine':>10} {'KL':>10} {'top1':>6} {'top5':>6}  result"
        lines = [header]
        for index, m in enumerate(self.prompts):
            verdict = "pass" if m.passes(self.thresholds) else "FAIL"
            lines.append(
                f"{index:>6} {m.tokens:>6} {m.max_abs_diff:>10.3g} {m.mean_abs_diff:>10.3g} {m.cosine:>10.7f} "
                f"{m.kl:>10.3g} {m.top1_agreement:>6.3f} {m.top5_overlap:>6.3f}  {verdict}"
            )
        t = self.thresholds
        lines.append(
            f"thresholds ({self.dtype}): cosine >= {t.min_cosine}, KL <= {t.max_kl:g}, top-1 >= {t.min_top1}"
        )
        if self.first_diverging_layer is not None:
            lines.append(f"hidden states first diverge at decoder layer {self.first_diverging_layer}")
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)
