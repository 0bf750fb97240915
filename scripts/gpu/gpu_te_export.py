"""Checkpoints that megatron-core saves under Transformer Engine's spec export bit-exactly.

    python scripts/gpu/gpu_te_export.py --work /tmp/te-export --out results/            # 2 GPUs, TE installed
    python scripts/gpu/gpu_te_export.py --work /tmp/x --out /tmp/x --device cpu --spec local   # the same on CPU

For each layout (TP=2; EP=2; TP=2 x EP=2 x ETP=1) and model (a Qwen3-MoE and a Qwen1.5-MoE with a shared expert
and a dense first layer; a dense Llama-3.1 at TP=2; shrunk from the real configs): megatron-core's GPTModel is built
with random weights under the spec (TE: TE linear layers, TEGroupedMLP experts from `moe_grouped_gemm`), saved
by megatron-core itself (`dist_checkpointing.save` of its sharded_state_dict, TE's `_extra_state` included),
exported with `mconvert mcore-to-hf --hf-config`, and compared with the model's own weights (megatron-core's
sharding metadata assembles them: gather_global_state; mapped to HF names) bit for bit. The model's args come
from an mconvert conversion of the shrunk HF model (its architecture only: the weights are the model's own
random ones). Each result is appended to OUT/te_export.jsonl as it comes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from mconvert.converters.state_dict import mcore_to_hf_state_dict  # noqa: E402
from mconvert.dtypes import as_torch  # noqa: E402
from mconvert.formats.hf_checkpoint import HFCheckpoint  # noqa: E402
from mconvert.mcore.parallelism import Parallelism  # noqa: E402
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink  # noqa: E402

MODELS = {
    "qwen3_moe": ("qwen3-30b-a3b", {}),
    "qwen2_moe-shared-expert-dense-first": ("qwen1.5-moe-a2.7b", {"mlp_only_layers": [0]}),
    "llama-dense": ("llama-3.1-8b", {}),
}
LAYOUTS = {"tp2": Parallelism(tp=2), "ep2": Parallelism(ep=2), "tp2ep2etp1": Parallelism(tp=2, ep=2, etp=1)}
SPECS = {"te": "transformer_engine", "local": "local"}


def save_with_megatron_core(jobs: list[tuple[str, str]], transformer_impl: str, device: str) -> list[dict]:
    """In each rank, for each (args checkpoint, save dir): a random-init GPTModel, saved by megatron-core.
    Returns on rank 0 per job the model's own tensors (whole, by checkpoint key) and what it was built of."""
    from megatron.core import dist_checkpointing, parallel_state

    from mconvert.mcore.checkpoint import iteration_dir, read_args
    from mconvert.verify.megatron_model import build_gpt_model
    from mconvert.verify.megatron_side import gather_global_state

    results = []
    for ours, save_dir in jobs:
        args = read_args(iteration_dir(Path(ours)))
        model = build_gpt_model(
            args, torch.float32,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            transformer_impl=transformer_impl,
        ).to(device)
        sharded = model.sharded_state_dict()
        dist_checkpointing.save(sharded, save_dir)
        modules = sorted({type(module).__name__ for module in model.modules()})
        results.append({"state": gather_global_state([model]), "modules": modules})
    return results


def extra_state_keys(save_dir: Path) -> int:
    """How many `_extra_state` entries megatron-core wrote (read from the DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    return sum("_extra_state" in key for key in FileSystemReader(str(save_dir)).read_metadata().state_dict_metadata)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--spec", choices=tuple(SPECS), default="te")
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=2)
    options = parser.parse_args()
    from mconvert.verify.distributed import run_ranks

    options.out.mkdir(parents=True, exist_ok=True)
    options.work.mkdir(parents=True, exist_ok=True)
    hf_dirs = {}
    for name, (config, overrides) in MODELS.items():
        hf_dirs[name] = options.work / f"{name}-hf"
        if not (hf_dirs[name] / "config.json").exists():
            make_hf_checkpoint(shrink(real_config(config), layers=options.layers, **overrides), hf_dirs[name])
    failures = 0
    for layout in options.layouts:
        parallelism = LAYOUTS[layout]
        started = time.perf_counter()
        # Expert parallelism is for the MoE models only.
        models = {name: hf for name, hf in hf_dirs.items() if parallelism.ep == 1 or MODELS[name][0] != "llama-3.1-8b"}
        jobs = []
        for name, hf in models.items():
            ours = options.work / f"{name}-{layout}-args"
            convert_hf_to_mcore(hf, ours, parallelism=parallelism, overwrite=True)
            save_dir = options.work / f"{name}-{layout}-saved"
            save_dir.mkdir(exist_ok=True)
            jobs.append((str(ours), str(save_dir)))
        try:
            saved = run_ranks(
                save_with_megatron_core, jobs, SPECS[options.spec], options.device, device=options.device,
                tp=parallelism.tp, pp=parallelism.pp, ep=parallelism.ep, etp=parallelism.etp, timeout_s=600,
            )
        except Exception:  # a rank failed: record it and go on with the next layout
            failures += 1
            record = {"layout": layout, "spec": options.spec, "passed": False, "error": traceback.format_exc()[-3000:]}
            print(json.dumps(record, indent=1), flush=True)
            with open(options.out / "te_export.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
            continue
        for (name, hf), (_, save_dir), result in zip(models.items(), jobs, saved):
            config = json.loads((hf / "config.json").read_text())
            own = mcore_to_hf_state_dict(result["state"], config)
            exported_dir = options.work / f"{name}-{layout}-exported"
            done = subprocess.run(
                [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", save_dir, "--save-dir",
                 str(exported_dir), "--hf-config", str(hf), "--overwrite"],
                capture_output=True, text=True, cwd=REPO,
            )
            record = {"layout": layout, "model": name, "spec": options.spec, "modules": result["modules"],
                      "extra_state_entries": extra_state_keys(Path(save_dir)), "export_exit": done.returncode}
            if done.returncode:
                record.update(passed=False, export_output=(done.stdout + done.stderr)[-3000:])
            else:
                exported = HFCheckpoint(exported_dir)
                differing = [k for k in own if k not in exported.tensors or not torch.equal(as_torch(exported.read(k)), own[k])]
                record.update(
                    tensors=len(own),
                    differing=differing[:20],
                    extra_names=sorted(set(exported.tensors) - set(own))[:20],
                    passed=not differing and set(exported.tensors) == set(own),
                )
            record["seconds"] = round(time.perf_counter() - started, 1)
            failures += not record["passed"]
            print(json.dumps(record, indent=1), flush=True)
            with open(options.out / "te_export.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
