"""Which side's gated delta-net kernels make the fp32 difference that `mconvert verify` shows for Qwen3-Next under
Transformer Engine on a GPU (and not on CPU ranks, where both sides run PyTorch): verify one converted checkpoint
four times, each side on flash-linear-attention's Triton kernels or on its own PyTorch path.

    python3 scripts/gpu/gdn_kernels.py --work DIR --out DIR MODEL:LAYOUT     # e.g. qwen3-next-80b-a3b-instruct@4:tp1

- transformers takes fla's chunked delta rule when it can import fla, else its own PyTorch one (the convolution and
  the gated norm are PyTorch either way without the causal-conv1d package);
- megatron-core's GatedDeltaNet runs fla's convolution, L2 norm and chunked delta rule, or, under
  `deterministic_mode`, its PyTorch convolution and delta rule, with the L2 norm in torch
  (mconvert.verify.cpu_shims.gated_delta_net_without_fla, as on CPU ranks).
Results, one JSON line a pairing, in OUT/gdn_kernels.jsonl as they come.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

PAIRINGS = (("fla", "fla"), ("torch", "torch"), ("torch", "fla"), ("fla", "torch"))


def megatron_side_on_pytorch() -> None:
    """Every GatedDeltaNet built from here on runs megatron-core's PyTorch convolution and delta rule."""
    from megatron.core.ssm.gated_delta_net import gdn

    from mconvert.verify import cpu_shims

    cpu_shims.gated_delta_net_without_fla()
    build = gdn.GatedDeltaNet.__init__

    def build_on_pytorch(self, config, *args, **kwargs):
        config = copy.copy(config)  # deterministic_mode for this module only
        config.deterministic_mode = True
        build(self, config, *args, **kwargs)

    gdn.GatedDeltaNet.__init__ = build_on_pytorch


# verify's GPU ranks are spawned processes, which run this file's top level as __mp_main__.
if __name__ == "__mp_main__" and os.environ.get("GDN_MEGATRON_KERNELS") == "torch":
    megatron_side_on_pytorch()


def verify_once(hf_kernels: str, megatron_kernels: str, verify_args: list[str]) -> int:
    """`mconvert verify` in this process (its ranks spawned from it) with each side's kernels as named."""
    os.environ["GDN_MEGATRON_KERNELS"] = megatron_kernels
    if hf_kernels == "torch":
        sys.modules["fla"] = None  # transformers imports fla for its delta rule, and falls back to PyTorch without it
    from mconvert.cli import main

    return main(["verify", *verify_args])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", help="MODEL:LAYOUT as gpu_verify.py takes it (fp32)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--try-on-cpu", action="store_true", help="try the script on CPU ranks (both sides run PyTorch there)")
    parser.add_argument("--once", nargs=2, metavar=("HF", "MEGATRON"), help=argparse.SUPPRESS)
    options, verify_args = parser.parse_known_args()
    if options.once:
        return verify_once(*options.once, verify_args)
    from gpu_verify import loaded_sizes, parse_job, run, write_hf_model

    model, sizes, _ = parse_job(options.job)
    hf, mcore = options.work / "hf", options.work / "mcore"
    options.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if options.try_on_cpu else "cuda"
    write_hf_model(model, hf, device)
    code, convert_s, output = run([sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(hf), "--save-dir",
                                   str(mcore), "--overwrite", "--dtype", "fp32", *(f"--{k}={v}" for k, v in sizes.items())])
    if code:
        print(output[-3000:])
        return 1
    for hf_kernels, megatron_kernels in PAIRINGS:
        report = options.work / f"{hf_kernels}-{megatron_kernels}.json"
        started = time.perf_counter()
        code, _, output = run([sys.executable, __file__, options.job, "--work", str(options.work), "--out", str(options.out),
                               "--once", hf_kernels, megatron_kernels, "--hf", str(hf), "--mcore", str(mcore), "--device", device,
                               *(["--spec", "te"] if device == "cuda" else []), "--json", str(report), *(f"--{k}={v}" for k, v in loaded_sizes(options.job).items())])
        result = {"job": options.job, "transformers": hf_kernels, "megatron_core": megatron_kernels, "exit": code,
                  "seconds": round(time.perf_counter() - started, 1), "output": output[-2500:]}
        if report.exists():
            result["report"] = json.loads(report.read_text())
        print(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=1), flush=True)
        with open(options.out / "gdn_kernels.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
