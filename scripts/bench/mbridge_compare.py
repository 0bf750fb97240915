"""mbridge 0.15.1 (the bridge verl uses) beside mconvert on CPU, tensor for tensor (docs/peers.md, "mbridge on CPU").

mbridge is installed beside the project's environment, not into it, and megatron-core 0.13.1 for its DeepSeek-V3
(whose config passes MLATransformerConfig a max_position_embeddings that megatron-core renamed in 0.14):

    .venv/bin/pip install --no-deps --target /tmp/mbridge-site mbridge==0.15.1 einops==0.8.2
    .venv/bin/pip install --no-deps --target /tmp/mcore-0.13.1 megatron-core==0.13.1
    PYTHONPATH=/tmp/mbridge-site .venv/bin/python scripts/bench/mbridge_compare.py --work DIR

For each model (random-init HF checkpoints in bf16, mconvert.synthetic) and layout it runs, each as a process of its
own, timed from start to exit with the peak resident memory of its process tree (scripts/bench/memory_split.py):
mconvert `hf-to-mcore` and `mcore-to-hf`; mbridge's `get_model(weight_path=...)` and `save_weights` (its model lives
in memory only), under torchrun with gloo ranks. Then, untimed, it loads mconvert's torch_dist checkpoint into a
second model built by mbridge (megatron-core's dist_checkpointing.load) and compares it with the model mbridge
loaded, every tensor of every rank; and both tools' HF exports with the original files. It also runs mbridge as its
README shows it, unchanged, and records the error. Results: DIR/results.json.

mbridge builds its models with Transformer Engine's layer spec and names (TELayerNormColumnParallelLinear's
`layer_norm_weight`, TEGroupedMLP's `weight{N}`), which megatron-core cannot build without TE. Here TE's classes are
stood in for by megatron-core's own CPU modules with the same parameter names and sharding (`cpu_te_backend`).
What else differs from mbridge's own way (`make_bridge`): transformers 5's configs get back the `rope_theta` (and
`rope_scaling`) mbridge reads; settings that hold no weight are set for CPU (use_cpu_initialization, the local
attention backend; for MoE the allgather dispatcher, fixed sequence lengths, no shared-expert overlap); DeepSeek-V3's
bf16 files are read by mbridge's plain reader, not its FP8 one (Triton, CUDA). mbridge's weight mappings, TP splits,
EP offsets, loading and export run unchanged.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# (label, mconvert config, config overrides, with MTP layers, TP, EP, megatron-core): 0.16.1 is the environment's;
# mbridge's DeepSeek-V3 config needs 0.13 (MLATransformerConfig's max_position_embeddings, renamed in 0.14).
NO_MTP = {"num_nextn_predict_layers": 0}
CASES = [
    ("Qwen2.5-0.5B (tied)", "qwen2.5-0.5b", {}, False, 1, 1, "0.16.1"),
    ("Qwen2.5-0.5B (tied)", "qwen2.5-0.5b", {}, False, 2, 1, "0.16.1"),
    ("Qwen2.5-7B (untied)", "qwen2.5-7b-instruct", {}, False, 1, 1, "0.16.1"),
    ("Qwen2.5-7B (untied)", "qwen2.5-7b-instruct", {}, False, 2, 1, "0.16.1"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", {}, False, 1, 1, "0.16.1"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", {}, False, 1, 2, "0.16.1"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", {}, False, 2, 2, "0.16.1"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", {}, False, 1, 2, "0.13.1"),
    ("DeepSeek-V3, no MTP", "deepseek-v3", NO_MTP, False, 1, 1, "0.16.1"),
    ("DeepSeek-V3, no MTP", "deepseek-v3", NO_MTP, False, 1, 1, "0.13.1"),
    ("DeepSeek-V3, no MTP", "deepseek-v3", NO_MTP, False, 2, 1, "0.13.1"),
    ("DeepSeek-V3, no MTP", "deepseek-v3", NO_MTP, False, 1, 2, "0.13.1"),
    ("DeepSeek-V3, 2 layers + 1 MTP layer", "deepseek-v3", {}, True, 1, 1, "0.13.1"),
    # mbridge converts DeepSeek-V3's MTP layer only after 61 layers: all 61, shrunk.
    ("DeepSeek-V3, 61 layers + 1 MTP layer", "deepseek-v3", {"num_hidden_layers": 61}, True, 1, 1, "0.13.1"),
    ("DeepSeek-V3, 61 layers + 1 MTP layer", "deepseek-v3", {"num_hidden_layers": 61}, True, 1, 2, "0.13.1"),
]


# ----------------------------------------------------------------------------------------------- rank side (torchrun)
def cpu_te_backend() -> None:
    """megatron-core's Transformer Engine spec built from its own CPU modules: the classes TE would give, with TE's
    parameter names and sharding, so that mbridge's TE-named mappings, TP splits and EP offsets run as they are.
    For megatron-core 0.13.1 and 0.16.1."""
    from megatron.core import parallel_state
    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from mconvert.verify import cpu_shims

    cpu_shims.mla_without_transformer_engine()
    groups_given = "tp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters  # 0.16 on

    class norm:  # TENorm: megatron's torch RMSNorm (`weight`), without the kernel choices only TE and apex have
        def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            plain = copy.copy(config)
            plain.sequence_parallel = plain.persist_layer_norm = False
            return WrappedTorchNorm(plain, hidden_size, eps, **kwargs)

    class LayerNormColumnParallelLinear(ColumnParallelLinear):  # TELayerNormColumnParallelLinear's parameters
        def __init__(self, input_size: int, output_size: int, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=kwargs["config"].params_dtype))

    class GroupedLinear(MegatronModule):  # TE's GroupedLinear: weight0..weight{N-1}, sharded as TE shards them
        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, pg_collection=None):
            super().__init__(config)
            self.num_gemms = num_gemms
            self.ep = pg_collection.ep if pg_collection else parallel_state.get_expert_model_parallel_group()
            self.tp = pg_collection.expt_tp if pg_collection else tp_group
            for i in range(num_gemms):
                linear = self.linear(input_size, output_size, config=config, init_method=init_method, bias=bias,
                                     skip_bias_add=skip_bias_add, is_expert=True, tp_group=self.tp)
                self.register_parameter(f"weight{i}", linear.weight)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            experts, first = self.ep.size() * self.num_gemms, self.ep.rank() * self.num_gemms
            groups = dict(tp_group=self.tp, dp_cp_group=metadata["dp_cp_group"]) if groups_given else {}
            out = {}
            for i in range(self.num_gemms):
                offsets = (*sharded_offsets, (len(sharded_offsets), first + i, experts))
                sub = make_sharded_tensors_for_checkpoint({"weight": getattr(self, f"weight{i}")}, prefix,
                                                          {"weight": self.axis}, offsets, **groups)
                tensor = out[f"{prefix}weight{i}"] = sub[f"{prefix}weight"]
                tensor.replica_id = (*tensor.replica_id[:2], parallel_state.get_expert_data_parallel_rank())
            return out

    class ColumnGrouped(GroupedLinear):
        axis = 0

        def linear(self, *args, **kwargs):
            return ColumnParallelLinear(*args, gather_output=False, **kwargs)

    class RowGrouped(GroupedLinear):
        axis = 1

        def linear(self, *args, **kwargs):
            return RowParallelLinear(*args, input_is_parallel=True, **kwargs)

    class CpuTESpecProvider(BackendSpecProvider):
        def linear(self):
            return cpu_shims.duplicated_linear()

        def column_parallel_linear(self):
            return ColumnParallelLinear

        def row_parallel_linear(self):
            return RowParallelLinear

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return LayerNormColumnParallelLinear

        def layer_norm(self, rms_norm=False, for_qk=False):
            return norm

        def core_attention(self):
            return cpu_shims.local_mla_core_attention()  # megatron's DotProductAttention (MLA's widths too)

        def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
            return TEGroupedMLP, MLPSubmodules(linear_fc1=ColumnGrouped, linear_fc2=RowGrouped)

        def activation_func(self):
            return None

    gpt_layer_specs.TENorm = norm
    gpt_layer_specs.TESpecProvider = moe_module_specs.TESpecProvider = CpuTESpecProvider
    function = moe_module_specs.get_moe_module_spec_for_backend  # 0.16.1: TESpecProvider() as a default argument
    if function.__defaults__:
        function.__defaults__ = tuple(CpuTESpecProvider() if type(d).__name__ == "TESpecProvider" else d
                                      for d in function.__defaults__)


def make_bridge(hf: str, tp: int):
    """mbridge's AutoBridge for `hf`, with Megatron-LM's vocabulary padding (128 x TP), as mconvert writes it."""
    from mbridge import AutoBridge
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf)
    # transformers 5 keeps rope_theta (and rope_scaling) only in rope_parameters; mbridge 0.15.1 reads them.
    config.rope_theta = config.rope_parameters["rope_theta"]
    if config.rope_parameters.get("rope_type", "default") != "default":
        config.rope_scaling = dict(config.rope_parameters)
    # DeepseekV3Bridge's own model provider never sets the vocabulary sizes that padding needs (its load asserts):
    # its embedding stays unpadded, and loads the first rows of mconvert's (megatron's allow_shape_mismatch).
    padding = None if config.model_type == "deepseek_v3" else 128 * tp
    bridge = AutoBridge.from_config(config, dtype=torch.bfloat16, make_vocab_size_divisible_by=padding)
    if type(bridge).__name__ == "DeepseekV3Bridge":
        # Its reader dequantizes FP8 with a Triton kernel (imported even for bf16 weights) on CUDA (safe_open(device=
        # "cuda")): these bf16 files are read by mbridge's plain SafeTensorIO, as its other bridges read theirs.
        from mbridge.core.bridge import Bridge

        bridge._get_safetensor_io = Bridge._get_safetensor_io.__get__(bridge)
    # CPU: parameters made on the CPU, megatron's own attention; for MoE the allgather dispatcher and no shared-expert
    # overlap (alltoall and the overlap make CUDA streams), which needs fixed sequence lengths. None holds a weight.
    extra = dict(use_cpu_initialization=True, attention_backend="local")
    if bridge.config.num_moe_experts:
        extra.update(moe_token_dispatcher_type="allgather", moe_shared_expert_overlap=False, variable_seq_lengths=False)
    bridge.set_extra_args(**extra)
    return bridge


def rank_mbridge(hf: str, out: str, tp: int) -> None:
    """What a user of mbridge runs: the model with the HF weights loaded, then the HF weights saved back."""
    cpu_te_backend()
    started = time.perf_counter()
    bridge = make_bridge(hf, tp)
    model = bridge.get_model(weight_path=hf, use_cpu_initialization=True)
    loaded = time.perf_counter()
    bridge.save_weights(model, out)
    if torch.distributed.get_rank() == 0:  # the phases, beside the export
        phases = {"load_s": round(loaded - started, 2), "save_s": round(time.perf_counter() - loaded, 2)}
        (Path(out).parent / "mbridge_phases.json").write_text(json.dumps(phases))


def rank_as_is(hf: str) -> None:
    """mbridge as its README shows it, unchanged: AutoBridge.from_pretrained, then get_model with the weights."""
    from mbridge import AutoBridge

    AutoBridge.from_pretrained(hf).get_model(weight_path=hf)


def rank_compare(hf: str, ckpt: str, tp: int, result: str) -> None:
    """mbridge's model loaded from HF against a second mbridge-built model loaded from mconvert's torch_dist."""
    from mbridge.core.util import unwrap_model
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint import FileSystemReader

    from mconvert.converters.rank_export import model_sharded_state_dict

    cpu_te_backend()
    bridge = make_bridge(hf, tp)
    ours = unwrap_model(bridge.get_model(weight_path=hf, use_cpu_initialization=True)[0])
    theirs = unwrap_model(bridge.get_model(use_cpu_initialization=True)[0])
    iteration = Path(ckpt) / (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip()
    iteration = iteration if iteration.name == "release" else Path(ckpt) / f"iter_{int(iteration.name):07d}"
    loaded, missing, unexpected = dist_checkpointing.load(model_sharded_state_dict(theirs), str(iteration),
                                                          strict=StrictHandling.RETURN_ALL)
    theirs.load_state_dict(loaded, strict=False)
    stored = FileSystemReader(str(iteration)).read_metadata().state_dict_metadata  # the checkpoint's own dtypes
    keys = {name: value.key for name, value in model_sharded_state_dict(theirs).items() if hasattr(value, "key")}
    rows, state = {}, theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        if "_extra_state" in name:
            continue
        other, key = state[name], f"{name} {tuple(tensor.shape)}"
        rows[key] = "equal" if tensor.dtype == other.dtype and torch.equal(tensor, other) else (
            f"differs: max |d| {(tensor.float() - other.float()).abs().max().item():.3g}, {tensor.dtype} / {other.dtype}")
        dtype = getattr(getattr(stored.get(keys.get(name)), "properties", None), "dtype", tensor.dtype)
        if dtype != tensor.dtype:
            rows[key] += f" (model {tensor.dtype}, checkpoint {dtype})"
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, rows)
    if torch.distributed.get_rank() == 0:
        Path(result).write_text(json.dumps({"ranks": every, "checkpoint_only": sorted(missing),
                                            "model_only": sorted(unexpected)}, indent=1))


# ------------------------------------------------------------------------------------------------------- driver
def timed(command: list[str], env: dict | None = None) -> dict:
    """One process, start to exit: seconds, peak RSS of its tree (memory_split.py), its output's last lines."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts/bench/memory_split.py"), "--", *command], env=env,
                         capture_output=True, text=True)
    line = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    seconds = re.match(r"([\d.]+) s,", line)
    rss = re.search(r"VmRSS (\d+) MiB", line)
    errors = re.findall(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .*)$", run.stderr, re.M)
    return {"ok": run.returncode == 0 and "exit 0" in line, "s": float(seconds[1]) if seconds else None,
            "peak_rss_mib": int(rss[1]) if rss else None, "summary": line, "error": errors[0] if errors else None}


def torchrun(world: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__, *args]


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def compare_hf(original: Path, exported: Path) -> dict:
    a, b = hf_tensors(original), hf_tensors(exported)
    both = sorted(a.keys() & b.keys())
    differ = [f"{k} {a[k].dtype}/{b[k].dtype} max|d| {(a[k].float() - b[k].float()).abs().max().item():.3g}"
              for k in both if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]))]
    return {"equal": len(both) - len(differ), "differ": differ, "original_only": sorted(a.keys() - b.keys()),
            "export_only": sorted(b.keys() - a.keys())}


def bf16_mtp_layer(path: Path) -> None:
    """add_mtp_layers makes the MTP layer's own tensors in the dtype of the first tensor safetensors reads, here the
    fp32 routing bias: bf16 as the rest (the routing biases stay fp32, as the hub stores them)."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


def folded(keys: list[str]) -> dict[str, int]:
    """Keys with their layer numbers folded (layers.N), each with how many there are."""
    counts: dict[str, int] = {}
    for key in keys:
        key = re.sub(r"layers\.\d+\.", "layers.N.", key)
        counts[key] = counts.get(key, 0) + 1
    return counts


def summarize(compare: dict) -> dict:
    """The per-rank rows folded: how many (rank, tensor) pairs are equal, and every one that is not."""
    rows = [(rank, key, result) for rank, table in enumerate(compare["ranks"]) for key, result in table.items()]
    only = [k for k in compare["checkpoint_only"] if not k.endswith("_extra_state")]
    return {"tensors_equal": sum(v.startswith("equal") for _, _, v in rows), "tensors": len(rows),
            "not_equal_or_dtype": [f"rank {r}: {k}: {v}" for r, k, v in rows if v != "equal"],
            "checkpoint_only": folded(only), "checkpoint_only_extra_state": len(compare["checkpoint_only"]) - len(only),
            "model_only": compare["model_only"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--only", default="", help="run only the cases whose config name contains this")
    parser.add_argument("--mcore013", type=Path, default=Path("/tmp/mcore-0.13.1"),
                        help="megatron-core 0.13.1 installed alone (pip install --no-deps --target DIR megatron-core==0.13.1)")
    options = parser.parse_args()
    from mconvert.synthetic import add_mtp_layers, make_hf_checkpoint, real_config, shrink

    work, results = options.work, []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    for label, name, overrides, mtp, tp, ep, mcore in CASES:
        if options.only not in name:
            continue
        hf = work / re.sub(r"\W+", "-", label.lower()).strip("-") / "hf"
        if not (hf / "config.json").exists():
            make_hf_checkpoint(shrink(real_config(name), layers=2, **overrides), hf, dtype="bfloat16", weight_std=0.1)
            if mtp:
                add_mtp_layers(hf)
                bf16_mtp_layer(hf / "mtp.safetensors")
        case = hf.parent / f"tp{tp}ep{ep}-mcore{mcore}"
        ckpt, back, mb_hf, out = case / "mconvert_torch_dist", case / "mconvert_hf", case / "mbridge_hf", case / "compare.json"
        mb_env = env if mcore == "0.16.1" else dict(env, PYTHONPATH=os.pathsep.join([str(options.mcore013), env["PYTHONPATH"]]))
        row = {"model": label, "tp": tp, "ep": ep, "megatron_core": mcore}
        etp = 1 if ep > 1 else tp  # experts unsplit by TP: 2 ranks for TP 2 x EP 2
        layout = ["--tp", str(tp), "--ep", str(ep), "--etp", str(etp)]
        row["mconvert_hf_to_mcore"] = timed([sys.executable, "-m", "mconvert", "hf-to-mcore", "--load-dir", str(hf),
                                             "--save-dir", str(ckpt), *layout, "--overwrite", "--quiet"], env)
        row["mconvert_mcore_to_hf"] = timed([sys.executable, "-m", "mconvert", "mcore-to-hf", "--load-dir", str(ckpt),
                                             "--save-dir", str(back), "--overwrite", "--quiet"], env)
        world = max(tp, ep)  # the smallest world of these layouts
        if tp == ep == 1:
            row["mbridge_as_is_error"] = timed(torchrun(1, "rank-as-is", str(hf), "-", "1", "1"), mb_env)["error"]
        row["mbridge"] = timed(torchrun(world, "rank-mbridge", str(hf), str(mb_hf), str(tp), str(ep)), mb_env)
        if row["mconvert_mcore_to_hf"]["ok"]:
            row["mconvert_export_vs_original"] = compare_hf(hf, back)
        if row["mbridge"]["ok"]:
            row["mbridge"]["phases"] = json.loads((case / "mbridge_phases.json").read_text())
            row["mbridge_export_vs_original"] = compare_hf(hf, mb_hf)
            run = subprocess.run(torchrun(world, "rank-compare", str(hf), str(ckpt), str(tp), str(ep), str(out)),
                                 env=mb_env, capture_output=True, text=True)
            row["model_state"] = summarize(json.loads(out.read_text())) if run.returncode == 0 else run.stderr[-4000:]
        results.append(row)
        print(json.dumps(row, indent=1)[:4000], flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))


def rank_entry() -> None:
    from mconvert.verify.distributed import run_ranks

    mode, hf, out_or_ckpt, tp, ep, *rest = sys.argv[1:]
    fn, args = {"rank-mbridge": (rank_mbridge, (hf, out_or_ckpt, int(tp))), "rank-as-is": (rank_as_is, (hf,)),
                "rank-compare": (rank_compare, (hf, out_or_ckpt, int(tp), *rest))}[mode]
    run_ranks(fn, *args, tp=int(tp), ep=int(ep), etp=1 if int(ep) > 1 else int(tp), timeout_s=1800)
    # Torn down before exit: a gloo group left to the interpreter's exit at times aborts a rank ("terminate called
    # without an active exception").
    from megatron.core import parallel_state

    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    rank_entry() if sys.argv[1:2] in (["rank-mbridge"], ["rank-as-is"], ["rank-compare"]) else main()
