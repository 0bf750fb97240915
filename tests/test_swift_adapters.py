"""ms-swift's LoRA adapter saves (ms-swift 4.6.0 with mcore-bridge 1.6.5) both ways: `adapter-to-hf` of a save, and
`adapter-to-mcore --layout ms-swift` of a PEFT adapter.

ms-swift cannot run here (mcore-bridge's LoRA layer imports Transformer Engine), so `swift_save` lays a save out as
their code does, read line by line:
- mcore_bridge/tuners/lora.py, LoraParallelLinear.update_layer: on a column-parallel base (linear_qkv, linear_fc1)
  lora_A is `_build_local_te_linear(in_features, r)` (a duplicated TELinear: whole on every rank, stored once) and
  lora_B `TEColumnParallelLinear(r, out_features * tp_size)` (each rank its own rows); on a row-parallel base
  (linear_proj, linear_fc2) lora_A is `TERowParallelLinear(in_features * tp_size, r)` (each rank its input columns)
  and lora_B duplicated; scaling `lora_alpha / r`, `lora_alpha / r**0.5` with use_rslora.
- LoraParallelLinear.sharded_state_dict: `tuners_sharded_state_dict` keys the factors `lora_A.default.weight` and
  `lora_B.default.weight` and applies `apply_swiglu_sharded_factory` to `base_layer.weight` alone: a rank's
  linear_fc1 rows are its gate rows then its up rows, so the stored lora_B is [g_0; u_0; g_1; u_1].
- swift/megatron/utils/megatron_lm_utils.py, save_mcore_checkpoint and `_filter_adapter_state_dict(peft_format=True)`:
  the lora keys alone under `iter_<N>/`, stacked over the layers (megatron-core's TransformerBlock), the tracker file;
  swift/megatron/trainers/base.py save_checkpoint: `checkpoint-<N>/` with the run's args.json copied in.
`test_megatron_cores_own_save_of_the_layout_exports_the_same` checks that layout against megatron-core's own
dist_checkpointing save of the TP ranks' factors. The judge is peft: its logits of the HF base with the exported adapter equal the logits of the base whose weights
are W + scale x B A, computed here from the ms-swift-layout tensors by this file's own reading of the layout.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from mconvert.cli import main
from mconvert.converters import swift_adapters
from mconvert.converters.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mconvert.formats.dcp_writer import DCPWriter
from tests.adapter_faults import swap_orientation, wrong_scaling

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BASE = Path(__file__).parent / "fixtures" / "megatron_bridge_lora" / "hf"  # Qwen2: 2 layers, hidden 64, 4 heads, 2 groups, ffn 128
LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 2, 64, 4, 2, 16, 128
QKV_ROWS = (HEADS + 2 * GROUPS) * HEAD_DIM
TOKENS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(11))
# fp32 on both sides: the logits agree to about 1e-6; a wrong adapter moves them by 0.1 or more.
LOGITS_TOLERANCE = 1e-4
ITERATION = 6
STACK = "decoder.layers."
# (linear, its input and output sizes, column-parallel)
LINEARS = {
    "self_attention.linear_qkv": (HIDDEN, QKV_ROWS, True),
    "self_attention.linear_proj": (HEADS * HEAD_DIM, HIDDEN, False),
    "mlp.linear_fc1": (HIDDEN, 2 * FFN, True),
    "mlp.linear_fc2": (FFN, HIDDEN, False),
}


def random_swift_tensors(r: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each linear's stacked lora_A [L, r, in] and lora_B [L, out, r] in ms-swift's global (stored) layout, std 0.1."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for linear, (into, out, _) in LINEARS.items():
        tensors[f"{STACK}{linear}.lora_A.default.weight"] = torch.randn(LAYERS, r, into, generator=generator) * 0.1
        tensors[f"{STACK}{linear}.lora_B.default.weight"] = torch.randn(LAYERS, out, r, generator=generator) * 0.1
    return tensors


def swift_args(r: int, alpha: float, tp: int, rslora: bool = False, **more) -> dict:
    return {"model": str(BASE), "tuner_type": "lora", "lora_rank": r, "lora_alpha": alpha, "lora_dropout": 0.05, "lora_bias": "none",
            "use_rslora": rslora, "target_modules": ["all-linear"], "modules_to_save": [], "tensor_model_parallel_size": tp, **more}


def swift_save(out: Path, tensors: dict[str, torch.Tensor], tp: int, args: dict, optimizer: bool = False) -> Path:
    """`out` as ms-swift's run folder: checkpoint-<N>/ with args.json, the tracker and iter_<N>/, each stacked key
    stored as the TP ranks save it (a chunk per rank and layer: lora_B of a column-parallel linear split on its rows,
    lora_A of a row-parallel one on its input, the duplicated factors whole); with `optimizer`, Adam's moments of
    each beside them, as a run without `--no_save_optim` saves them (a non-distributed optimizer's keys)."""
    folder = out / f"checkpoint-{ITERATION}"
    directory = folder / f"iter_{ITERATION:07d}"
    directory.mkdir(parents=True)
    writer = DCPWriter(directory)
    for key, tensor in tensors.items():
        writer.declare(key, tuple(tensor.shape), np.dtype(np.float32))
        linear, factor = key[len(STACK):].rsplit(".lora_", 1)
        if linear.startswith("mlp.experts.experts."):  # one gemm per expert, expert TP 1: each expert's factor whole
            for layer, expert in np.ndindex(*tensor.shape[:2]):
                writer.write_chunk(key, (layer, expert, 0, 0), np.ascontiguousarray(tensor[layer, expert : expert + 1].numpy()[None]))
            continue
        column = LINEARS[linear][2]
        axis = 1 if factor.startswith("B") and column else 2 if factor.startswith("A") and not column else None
        for layer in range(LAYERS):
            blocks = torch.chunk(tensor[layer], tp, dim=axis - 1) if axis else [tensor[layer]]
            for rank, block in enumerate(blocks):
                at = [layer, 0, 0]
                if axis:
                    at[axis] = rank * block.shape[axis - 1]
                writer.write_chunk(key, tuple(at), np.ascontiguousarray(block.numpy()))
    for key, tensor in tensors.items() if optimizer else ():
        writer.declare(f"optimizer.state.exp_avg.{key}", tuple(tensor.shape), np.dtype(np.float32))
        writer.write_chunk(f"optimizer.state.exp_avg.{key}", (0,) * tensor.ndim, np.ascontiguousarray(tensor.numpy()))
    writer.finish()
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (folder / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    (folder / "args.json").write_text(json.dumps(args))
    return out


@functools.cache
def _base():
    return transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()


def base_model():
    """A fresh copy of the HF base model in fp32 (loaded once)."""
    return copy.deepcopy(_base())


def megatron_core_save(directory: str, tensors: dict[str, torch.Tensor]) -> None:
    """On each TP rank: the rank's part of each factor as mcore-bridge's layer holds it, made a ShardedTensor by
    megatron-core's own helpers as the factor's linear makes it (`make_tp_sharded_tensor_for_checkpoint` on its
    split axis for TEColumnParallelLinear's and TERowParallelLinear's weights, `make_sharded_tensor_for_checkpoint`
    for a duplicated TELinear's), per layer with the layer offset TransformerBlock prepends, and saved by
    `dist_checkpointing.save`."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.utils import (
        make_sharded_tensor_for_checkpoint,
        make_tp_sharded_tensor_for_checkpoint,
    )

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    state = {}
    for key, tensor in tensors.items():
        linear, factor = key[len(STACK):].rsplit(".lora_", 1)
        column = LINEARS[linear][2]
        axis = 0 if factor.startswith("B") and column else 1 if factor.startswith("A") and not column else None
        for layer in range(LAYERS):
            local = (tensor[layer] if axis is None else torch.chunk(tensor[layer], tp, dim=axis)[rank]).contiguous()
            at = ((0, layer, LAYERS),)
            state[f"{STACK}{layer}.{key[len(STACK):]}"] = (
                make_sharded_tensor_for_checkpoint(local, key, at) if axis is None
                else make_tp_sharded_tensor_for_checkpoint(local, key, axis, prepend_offsets=at)
            )
    dist_checkpointing.save(state, directory)


def merged_base(tensors: dict[str, torch.Tensor], tp: int, scale: float):
    """The HF base with W + scale x B A in each adapted projection, B A read from the ms-swift layout: linear_qkv's
    rows per query group [q heads; k; v], linear_fc1's per TP rank [gate; up]."""
    model = base_model()
    weights = model.state_dict()
    for layer in range(LAYERS):
        def delta(linear, layer=layer):
            a, b = (tensors[f"{STACK}{linear}.lora_{f}.default.weight"][layer] for f in "AB")
            return scale * (b @ a)

        at = f"model.layers.{layer}."
        groups = delta("self_attention.linear_qkv").reshape(GROUPS, -1, HIDDEN)
        per_group = HEADS // GROUPS * HEAD_DIM
        parts = {"q": groups[:, :per_group], "k": groups[:, per_group : per_group + HEAD_DIM], "v": groups[:, per_group + HEAD_DIM :]}
        for p, rows in parts.items():
            weights[f"{at}self_attn.{p}_proj.weight"] += rows.reshape(-1, HIDDEN)
        weights[f"{at}self_attn.o_proj.weight"] += delta("self_attention.linear_proj")
        ranks = delta("mlp.linear_fc1").reshape(tp, 2, FFN // tp, HIDDEN)
        weights[f"{at}mlp.gate_proj.weight"] += ranks[:, 0].reshape(FFN, HIDDEN)
        weights[f"{at}mlp.up_proj.weight"] += ranks[:, 1].reshape(FFN, HIDDEN)
        weights[f"{at}mlp.down_proj.weight"] += delta("mlp.linear_fc2")
    model.load_state_dict(weights)
    return model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def peft_logits(adapter: Path) -> torch.Tensor:
    return logits(peft.PeftModel.from_pretrained(base_model(), adapter).eval())


def to_hf(load_dir: Path, out: Path, *flags: str) -> Path:
    assert main(["adapter-to-hf", "--load-dir", str(load_dir), "--hf-config", str(BASE), "--save-dir", str(out), *flags]) == 0
    return out


SAVES = {"tp1": (1, False), "tp2": (2, False), "tp2-rslora": (2, True)}


@pytest.mark.parametrize("save", SAVES)
def test_peft_gives_the_logits_of_the_base_with_the_saved_delta(save, tmp_path):
    tp, rslora = SAVES[save]
    tensors = random_swift_tensors()
    run = swift_save(tmp_path / "run", tensors, tp, swift_args(8, 16.0, tp, rslora), optimizer=tp == 2)
    adapter = to_hf(run, tmp_path / "adapter")  # the run's folder: its newest checkpoint-N
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"], config["lora_dropout"]) == (8, 16.0, rslora, 0.05)
    reference = logits(merged_base(tensors, tp, 16.0 / (math.sqrt(8) if rslora else 8)))
    assert (peft_logits(adapter) - reference).abs().max().item() < LOGITS_TOLERANCE
    # The adapter matters: the base alone is far from it.
    assert (logits(base_model()) - reference).abs().max().item() > 0.1


def _qkv_rows_ungrouped(adapter: Path) -> None:
    """q/k/v's lora_B rows as if linear_qkv's were all queries, then all keys, then all values (not per group)."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    for layer in range(LAYERS):
        names = [f"base_model.model.model.layers.{layer}.self_attn.{p}_proj.lora_B.weight" for p in "qkv"]
        fused = torch.cat([tensors[n] for n in names]).reshape(GROUPS, -1, 8)
        per_group = HEADS // GROUPS * HEAD_DIM
        split = (fused[:, :per_group], fused[:, per_group : per_group + HEAD_DIM], fused[:, per_group + HEAD_DIM :])
        for name, rows in zip(names, split):
            tensors[name] = rows.reshape(-1, 8).contiguous()
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS))


@pytest.mark.parametrize("fault", ["orientation", "scaling", "qkv_rows", "fc1_rank_order"])
def test_each_fault_fails_the_check(fault, tmp_path, monkeypatch):
    tensors = random_swift_tensors()
    run = swift_save(tmp_path / "run", tensors, 2, swift_args(8, 16.0, 2)) / f"checkpoint-{ITERATION}" / f"iter_{ITERATION:07d}"
    if fault == "fc1_rank_order":  # linear_fc1's lora_B read as [gate; up] whole, its TP 2 storage order kept
        monkeypatch.setattr(swift_adapters, "gated_rows_from_ranks", lambda b, tp: b)
    adapter = to_hf(run, tmp_path / "adapter")
    {"orientation": swap_orientation, "scaling": wrong_scaling, "qkv_rows": _qkv_rows_ungrouped}.get(fault, lambda a: None)(adapter)
    reference = logits(merged_base(tensors, 2, 2.0))
    assert (peft_logits(adapter) - reference).abs().max().item() > 100 * LOGITS_TOLERANCE


def make_peft_adapter(out: Path, rslora: bool = False) -> Path:
    """peft's own adapter of every projection of the base (std 0.1), q/k/v and gate/up of a layer sharing lora_A,
    as one ms-swift lora_A of a fused linear has."""
    model = base_model()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, use_rslora=rslora, target_modules=targets))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        for layer in model.base_model.model.model.layers:
            for first, *others in ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], [layer.mlp.gate_proj, layer.mlp.up_proj]):
                for other in others:
                    other.lora_A["default"].weight.copy_(first.lora_A["default"].weight)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("tp, rslora", [(2, True), (1, False)])
def test_a_peft_adapter_round_trips_through_ms_swifts_layout_bit_for_bit(tp, rslora, tmp_path):
    adapter = make_peft_adapter(tmp_path / "peft", rslora)
    save = tmp_path / "swift"
    assert main(["adapter-to-mcore", "--adapter", str(adapter), "--hf-config", str(BASE), "--save-dir", str(save), "--layout", "ms-swift", "--tp", str(tp)]) == 0
    args = json.loads((save / "args.json").read_text())
    assert (args["tuner_type"], args["lora_rank"], args["lora_alpha"], args["use_rslora"], args["tensor_model_parallel_size"]) == ("lora", 8, 16.0, rslora, tp)
    assert args["target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    # The written save, read by torch's own DCP reader, holds the delta peft's adapter adds, in ms-swift's layout.
    directory = save / f"iter_{swift_adapters.ITERATION:07d}"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(swift_adapters.ITERATION)
    # What ms-swift's load_mcore_checkpoint reads first: the args' TP and PP sizes, through megatron-core.
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(directory))
    assert (common["args"].tensor_model_parallel_size, common["args"].pipeline_model_parallel_size, common["iteration"]) == (tp, 1, 1)
    written = {key: torch.empty(LAYERS, *(shape[1:])) for key, shape in ((k, t.shape) for k, t in random_swift_tensors().items())}
    dcp.load(written, checkpoint_id=str(directory), no_dist=True)
    scale = 16.0 / (math.sqrt(8) if rslora else 8)
    assert (logits(merged_base(written, tp, scale)) - peft_logits(adapter)).abs().max().item() < LOGITS_TOLERANCE
    # And back (the base found from args.json's `model`): the same tensors, bit for bit, and the same settings.
    assert main(["adapter-to-hf", "--load-dir", str(save), "--save-dir", str(tmp_path / "back")]) == 0
    back = tmp_path / "back"
    original, returned = load_file(adapter / ADAPTER_WEIGHTS), load_file(back / ADAPTER_WEIGHTS)
    assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)
    config, config_back = (json.loads((d / ADAPTER_CONFIG).read_text()) for d in (adapter, back))
    for field in ("r", "lora_alpha", "use_rslora", "lora_dropout"):
        assert config[field] == config_back[field], field
    assert sorted(config["target_modules"]) == config_back["target_modules"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (swift_args(8, 16.0, 2, tuner_type="full"), "tuner_type is 'full'; adapter-to-hf reads ms-swift's LoRA saves"),
        (swift_args(8, 16.0, 2, lora_bias="all"), "lora_bias is 'all'"),
        (swift_args(8, 16.0, 1), "'decoder.layers.mlp.linear_fc1.lora_B.default.weight': stored in 2 row blocks where args.json records tensor_model_parallel_size 1"),
        (swift_args(4, 16.0, 2), "not rank 4, the lora_rank of args.json"),
    ],
    ids=["full", "lora_bias", "tp_record", "rank"],
)
def test_what_adapter_to_hf_cannot_read_is_refused_in_one_line(args, expected, tmp_path, capsys):
    run = swift_save(tmp_path / "run", random_swift_tensors(), 2, args)
    capsys.readouterr()
    code = main(["adapter-to-hf", "--load-dir", str(run / f"checkpoint-{ITERATION}"), "--hf-config", str(BASE), "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_save_that_names_no_base_needs_hf_config(tmp_path, capsys):
    args = swift_args(8, 16.0, 1)
    del args["model"]
    run = swift_save(tmp_path / "run", random_swift_tensors(), 1, args)
    capsys.readouterr()
    assert main(["adapter-to-hf", "--load-dir", str(run), "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "its save names no HF base model; pass --hf-config" in err and len(err.strip().splitlines()) == 1, err


MOE_BASE = Path(__file__).parent / "fixtures" / "megatron_bridge_lora" / "moe-lora" / "hf"  # Qwen3-MoE: 4 experts of width 32


def test_expert_adapters_become_peft_target_parameters_with_the_saved_delta(tmp_path):
    """LoRA on the routed experts (TEGroupedMLP): per expert lora_A [r, in] and lora_B [out, r] along the expert axis;
    peft's logits are the base's with W_e + scale x B_e A_e in transformers' fused gate_up_proj and down_proj."""
    experts, ffn, r = 4, 32, 4
    generator = torch.Generator().manual_seed(5)
    shapes = {"linear_fc1": (HIDDEN, 2 * ffn), "linear_fc2": (ffn, HIDDEN)}
    tensors = {}
    for linear, (into, out) in shapes.items():
        tensors[f"{STACK}mlp.experts.experts.{linear}.lora_A.default.weight"] = torch.randn(LAYERS, experts, r, into, generator=generator) * 0.1
        tensors[f"{STACK}mlp.experts.experts.{linear}.lora_B.default.weight"] = torch.randn(LAYERS, experts, out, r, generator=generator) * 0.1
    run = swift_save(tmp_path / "run", tensors, 1, dict(swift_args(r, 8.0, 1), model=str(MOE_BASE)))
    assert main(["adapter-to-hf", "--load-dir", str(run), "--save-dir", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == [f"model.layers.{i}.mlp.experts.{p}" for i in range(LAYERS) for p in ("down_proj", "gate_up_proj")]
    base = transformers.AutoModelForCausalLM.from_pretrained(MOE_BASE, dtype=torch.float32).eval()
    reference = copy.deepcopy(base)
    weights = reference.state_dict()  # the parameters themselves: changed in place
    for layer in range(LAYERS):
        for linear, param in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
            a, b = (tensors[f"{STACK}mlp.experts.experts.{linear}.lora_{f}.default.weight"][layer] for f in "AB")
            weights[f"model.layers.{layer}.mlp.experts.{param}"] += 2.0 * (b @ a)  # scale 8 / 4; HF's [E, out, in]
    with torch.no_grad():
        expected, unadapted = reference(TOKENS).logits, base(TOKENS).logits
        got = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(TOKENS).logits
    assert (got - expected).abs().max().item() < LOGITS_TOLERANCE
    assert (unadapted - expected).abs().max().item() > 0.1  # the expert adapters matter
    # Fault: lora_B stacked expert-major ([out, E, r]) where PEFT reads it rank-major ([out, r, E]).
    adapter = tmp_path / "adapter"
    stacked = load_file(adapter / ADAPTER_WEIGHTS)
    for name in [n for n in stacked if "experts" in n and "lora_B" in n]:
        out = stacked[name].shape[0]
        stacked[name] = stacked[name].reshape(out, r, experts).transpose(1, 2).reshape(out, -1).contiguous()
    save_file(stacked, str(adapter / ADAPTER_WEIGHTS))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(MOE_BASE, dtype=torch.float32)
        wrong = peft.PeftModel.from_pretrained(base, adapter).eval()(TOKENS).logits
    assert (wrong - expected).abs().max().item() > 100 * LOGITS_TOLERANCE


def test_models_mcore_bridge_lays_out_otherwise_are_refused_in_one_line(tmp_path, capsys):
    """Qwen3-Next: mcore-bridge's gated linear_qkv and fused delta-net projections (converters.swift_saves)."""
    base = tmp_path / "qwen3-next"
    base.mkdir()
    shutil.copy(Path(__file__).parents[1] / "mconvert" / "configs" / "qwen3-next-80b-a3b-instruct.json", base / "config.json")
    run = swift_save(tmp_path / "run", random_swift_tensors(), 1, swift_args(8, 16.0, 1))
    capsys.readouterr()
    assert main(["adapter-to-hf", "--load-dir", str(run), "--hf-config", str(base), "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "(mcore-bridge's gated attention and delta-net layouts) are not converted yet" in err and len(err.strip().splitlines()) == 1, err


def test_megatron_cores_own_save_of_the_layout_exports_the_same(tmp_path):
    """The save as megatron-core's dist_checkpointing writes it from the TP 2 ranks' factors (gloo, 2 CPU ranks)
    is stored in the chunks `swift_save` writes, and exports to the same adapter, bit for bit."""
    from mconvert.formats.dcp import DCPCheckpoint
    from mconvert.verify.distributed import run_ranks

    tensors = random_swift_tensors()
    emulated = swift_save(tmp_path / "emulated", tensors, 2, swift_args(8, 16.0, 2)) / f"checkpoint-{ITERATION}"
    folder = tmp_path / "megatron-core" / f"checkpoint-{ITERATION}"
    (folder / f"iter_{ITERATION:07d}").mkdir(parents=True)
    run_ranks(megatron_core_save, str(folder / f"iter_{ITERATION:07d}"), tensors, tp=2, timeout_s=300)
    for name in ("args.json", "latest_checkpointed_iteration.txt"):
        shutil.copy(emulated / name, folder / name)
    chunks = [
        {key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in checkpoint.metadata.state_dict_metadata[key].chunks) for key in tensors}
        for checkpoint in (DCPCheckpoint(d / f"iter_{ITERATION:07d}") for d in (emulated, folder))
    ]
    assert chunks[0] == chunks[1]
    ours, theirs = (load_file(to_hf(d, tmp_path / f"adapter-{d.parent.name}") / ADAPTER_WEIGHTS) for d in (emulated, folder))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
