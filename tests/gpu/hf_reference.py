"""transformers' fp32 logits, the reference of the GPU tests' Megatron-LM logits.

    python tests/gpu/hf_reference.py --tokens TOKENS.pt --out DIR [--device cpu|cuda] NAME=HF_DIR...

Writes DIR/NAME.pt for each model: the logits [prompts, tokens, vocab] of the prompts in TOKENS.pt (or DIR/NAME.error,
the model's failure, and goes on with the next). On the CPU (the default), or on the GPU with TF32 off for a family
whose own logits depend on the device (gpu_cases.Family.reference_on_gpu). With PyTorch's own kernels: flash-linear-attention, which the GPU runs install for megatron-core's gated delta-net, is
hidden from transformers (it would take its Triton kernels, which need CUDA tensors), as
scripts/gpu/gpu_train.py's check hides it.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.modules["fla"] = None  # before transformers looks for it

import torch  # noqa: E402

from mconvert.verify.hf_side import load_hf_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="NAME=HF_DIR")
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    tokens = torch.load(options.tokens).to(options.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for entry in options.models:
        name, _, hf_dir = entry.partition("=")
        try:
            model = load_hf_model(hf_dir, torch.float32).eval().to(options.device)
            with torch.no_grad():
                logits = model(input_ids=tokens).logits.float().cpu()
        except Exception:  # noqa: BLE001 (said in the model's file, which its test reads)
            (options.out / f"{name}.error").write_text(traceback.format_exc())
            continue
        torch.save(logits, options.out / f"{name}.pt.tmp")
        (options.out / f"{name}.pt.tmp").rename(options.out / f"{name}.pt")  # whole when its test sees it
        print(name, tuple(logits.shape), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
