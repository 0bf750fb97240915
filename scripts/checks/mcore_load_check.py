"""The CPU load check against the megatron-core this interpreter imports: `mconvert verify --device cpu` (megatron's
`dist_checkpointing.load` into its `GPTModel` on gloo ranks, logits against transformers' in fp32) on shrunk
random-init models converted by `mconvert hf-to-mcore`, printing one Markdown table row per model.

    python scripts/checks/mcore_load_check.py --work DIR --expect VERSION [--models NAME...]

--expect is the megatron-core version the run must import (it fails otherwise: PYTHONPATH shadowing that did not
take would test another version). The models and their checkpoints are made in DIR on the first run and reused by
the next ones, so every version loads the same files. scripts/checks/mcore_versions.sh runs it for each version.
Exit 0 when every model gives the expected result: a pass, or, for a model the version cannot build, the one-line
error verify gives for it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from mconvert.cli import main as mconvert_main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink


@dataclass(frozen=True)
class Model:
    name: str
    config: str
    parallelism: Parallelism
    # The megatron-core versions that can build the model, from `since` and before `until`; verify refuses it
    # with this message outside them.
    since: Version | None = None
    until: Version | None = None
    refusal: str = ""

    def builds_in(self, version: Version) -> bool:
        return (self.since is None or version >= self.since) and (self.until is None or version < self.until)

    @property
    def layout_flags(self) -> list[str]:
        par = self.parallelism
        return ["--tp", str(par.tp), "--pp", str(par.pp), "--ep", str(par.ep)]


MODELS = {
    # GQA (2 of 4 heads), QK-norm, head_dim != hidden / heads.
    "dense": Model("dense: Qwen3, TP=2", "qwen3-8b", Parallelism(tp=2)),
    "moe": Model("MoE: Qwen3-MoE, EP=2", "qwen3-30b-a3b", Parallelism(ep=2)),
    # Shared experts with a sigmoid gate: TransformerConfig.moe_shared_expert_gate exists from 0.16 on.
    "gated": Model(
        "MoE, gated shared expert: Qwen1.5-MoE, EP=2",
        "qwen1.5-moe-a2.7b",
        Parallelism(ep=2),
        since=Version("0.16"),
        refusal="its TransformerConfig has no moe_shared_expert_gate (the model has moe_shared_expert_gate=True)",
    ),
    # Multi-latent attention without a query bottleneck (q_lora_rank null), which megatron-core 0.19 builds with a
    # layer norm fused into linear_q_proj that the model does not have.
    "mla": Model(
        "MLA without q_lora_rank: DeepSeek-V2-Lite, EP=2",
        "deepseek-v2-lite",
        Parallelism(ep=2),
        until=Version("0.19"),
        refusal="for multi-latent attention without q_lora_rank it adds a layer norm before linear_q_proj",
    ),
    # The other families, for a wider run (--models).
    "llama": Model("dense: Llama-3.1 (llama3 rope scaling), TP=2", "llama-3.1-8b", Parallelism(tp=2)),
    "qwen2": Model("dense: Qwen2.5 (QKV bias), PP=2", "qwen2.5-7b-instruct", Parallelism(pp=2)),
    "mixtral": Model("MoE: Mixtral, PP=2 x EP=2", "mixtral-8x7b-v0.1", Parallelism(pp=2, ep=2)),
    "deepseek": Model("MLA, sigmoid routing with expert bias, YaRN: DeepSeek-V3, EP=2", "deepseek-v3", Parallelism(ep=2)),
}
DEFAULT_MODELS = ("dense", "moe", "gated", "mla")


def imported_version() -> str:
    import megatron.core

    return megatron.core.__version__


def prepared(model: Model, work: Path) -> tuple[Path, Path]:
    """The model's HF checkpoint and its conversion, made on the first call."""
    stem = work / model.config
    hf, mcore = stem.with_name(stem.name + "-hf"), stem.with_name(stem.name + "-mcore")
    if not (hf / "config.json").exists():
        # Two layers per pipeline stage.
        make_hf_checkpoint(shrink(real_config(model.config), layers=2 * model.parallelism.pp), hf)
    if not mcore.exists():
        convert_hf_to_mcore(hf, mcore, parallelism=model.parallelism)
    return hf, mcore


@dataclass(frozen=True)
class Outcome:
    expected: bool
    result: str
    max_abs_diff: float | None = None
    note: str = ""

    def row(self, version: str, model: Model) -> str:
        diff = "" if self.max_abs_diff is None else f"{self.max_abs_diff:.2g}"
        return f"| {version} | {platform.python_version()} | {model.name} | {self.result} | {diff} | {self.note} |"


def check(model: Model, work: Path, version: Version) -> Outcome:
    hf, mcore = prepared(model, work)
    report = work / "report.json"
    report.unlink(missing_ok=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mconvert_main(
            ["verify", "--hf", str(hf), "--mcore", str(mcore), "--device", "cpu", *model.layout_flags, "--json", str(report)]
        )
    last_line = (err.getvalue().strip() or out.getvalue().strip() or "(no output)").splitlines()[-1]
    if not model.builds_in(version):
        one_line = len(err.getvalue().strip().splitlines()) == 1
        return Outcome(code == 2 and one_line and model.refusal in last_line, "refused, as expected", note=f"`{last_line}`")
    if code != 0:
        return Outcome(False, f"FAIL (exit {code})", note=f"`{last_line}`")
    worst = max(prompt["max_abs_diff"] for prompt in json.loads(report.read_text())["prompts"])
    return Outcome(True, "pass", worst)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="directory for the models and checkpoints")
    parser.add_argument("--expect", required=True, help="the megatron-core version this run must import")
    parser.add_argument(
        "--models", nargs="+", choices=MODELS, default=DEFAULT_MODELS, help="default: %(default)s"
    )
    options = parser.parse_args()

    from mconvert.verify.distributed import run_ranks

    # In this process and in the ranks verify starts (the same interpreter, path and environment).
    versions = {imported_version(), run_ranks(imported_version, tp=2)}
    # A build may carry a local label (0.19.2+54a5123): the release is what is compared.
    if {Version(version).public for version in versions} != {Version(options.expect).public}:
        print(f"mcore_load_check: expected megatron-core {options.expect}, imported {sorted(versions)}", file=sys.stderr)
        return 1
    options.work.mkdir(parents=True, exist_ok=True)
    all_expected = True
    for model in map(MODELS.get, options.models):
        outcome = check(model, options.work, Version(options.expect))
        all_expected &= outcome.expected
        print(outcome.row(options.expect, model), flush=True)
    return 0 if all_expected else 1


if __name__ == "__main__":
    sys.exit(main())
