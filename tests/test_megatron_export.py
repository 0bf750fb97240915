"""The real client: checkpoints that megatron-core itself saved (its GPTModel on gloo CPU ranks: dense at
TP=2 x PP=2, MoE at EP=2, at TP=2 x EP=2 with ETP=1 and at PP=2 x EP=2), in torch_dist through
`dist_checkpointing.save` and in the legacy per-rank `torch` format as Megatron-LM writes it, export to the
original HF tensors bit for bit; and the same ranks hand out HF weights directly (the RL weight-sync path),
gathered over their TP and expert groups."""

from __future__ import annotations

import argparse
import json
import random
import weakref
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.rank_export import gather_hf_weights
from mconvert.converters.state_dict import mcore_to_hf_state_dict
from mconvert.dtypes import as_torch
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.mcore.checkpoint import RELEASE, TRACKER_FILE, read_args
from mconvert.mcore.parallelism import Parallelism

# The megatron-core harness (CPU shims, gloo ranks, model loading) lives in mconvert.verify.
from mconvert.verify.distributed import run_ranks
from mconvert.verify.megatron_side import gather_global_state, load_model


def read_hf(directory: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(directory)
    return {name: as_torch(checkpoint.read(name)) for name in checkpoint.tensors}


def legacy_rank_dir(iteration_dir: Path) -> Path:
    """This rank's directory in Megatron-LM's legacy format (its get_checkpoint_name): the pipeline rank only
    with PP > 1, the expert-parallel rank only with EP > 1."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return iteration_dir / name


def save_as_megatron_does(checkpoints: list[tuple[str, str, str, str]]) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    """In each rank, for each (ours, HF original, dist dir, legacy dir): load our checkpoint into megatron-core's
    GPTModel; save it with megatron-core's own dist_checkpointing and, per rank, in Megatron-LM's legacy format;
    then gather HF weights from the live model and check them against the HF originals, one at a time.
    Returns on rank 0, per checkpoint, the HF names all ranks produced and megatron-core's own view of the
    model's tensors (gather_global_state)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    results = []
    for ours, hf_dir, dist_dir, legacy_dir in checkpoints:
        args = read_args(Path(ours) / RELEASE)
        (model,) = load_model(ours, args, torch.float32, transformer_impl="local")

        dist_checkpointing.save(model.sharded_state_dict(), dist_dir)

        rank_dir = legacy_rank_dir(Path(legacy_dir) / "iter_0000010")
        rank_dir.mkdir(parents=True, exist_ok=True)
        # What Megatron-LM's save_checkpoint stores besides the model (RNG state with numpy's, optimizer state).
        rng_state = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(), "torch_rng_state": torch.get_rng_state()}
        optimizer = {"state": {i: {"exp_avg": torch.zeros_like(p)} for i, p in enumerate(model.parameters())}}
        layout = dict(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
        saved_args = argparse.Namespace(**{**vars(args), **layout})
        state = {"args": saved_args, "checkpoint_version": 3.0, "iteration": 10, "model": model.state_dict(), "optimizer": optimizer, "rng_state": [rng_state]}
        torch.save(state, rank_dir / "model_optim_rng.pt")
        if dist.get_rank() == 0:
            (Path(legacy_dir) / TRACKER_FILE).write_text("10")

        config = json.loads((Path(hf_dir) / "config.json").read_text())
        original = read_hf(Path(hf_dir))
        produced, alive = [], []
        for name, tensor in gather_hf_weights(model, config):
            assert torch.equal(tensor, original[name]), name
            produced.append(name)
            # Bounded memory: tensors the caller let go of are gone but for the current piece's (at most 3:
            # q, k and v).
            alive = [ref for ref in alive if ref() is not None] + [weakref.ref(tensor)]
            del tensor
            assert len(alive) <= 3, (name, len(alive))
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, produced)
        results.append((sorted({name for names in everyone for name in names}), gather_global_state([model])))
    return results


def run_megatron_saves(tmp_path: Path, models: dict[str, Path], parallelism: Parallelism) -> dict[str, tuple[list[str], dict]]:
    """Convert each HF model and have megatron-core save it, all in one spawn of ranks; per model, what
    save_as_megatron_does returns."""
    checkpoints = []
    for name, hf in models.items():
        convert_hf_to_mcore(hf, tmp_path / f"{name}-ours", parallelism=parallelism)
        (tmp_path / f"{name}-dist").mkdir()
        checkpoints.append((str(tmp_path / f"{name}-ours"), str(hf), str(tmp_path / f"{name}-dist"), str(tmp_path / f"{name}-legacy")))
    p = parallelism
    return dict(zip(models, run_ranks(save_as_megatron_does, checkpoints, tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp)))


def export_both_formats(tmp_path: Path, name: str, hf: Path, capsys) -> dict[str, dict[str, torch.Tensor]]:
    """mcore-to-hf of what megatron-core saved. Its bare dist_checkpointing.save stores no args: the reference
    config describes the model. The legacy files carry Megatron-LM's args, which alone do."""
    exports = {}
    for fmt, flags in (("dist", ["--hf-config", str(hf)]), ("legacy", [])):
        out = tmp_path / f"{name}-{fmt}-hf"
        code = main(["mcore-to-hf", "--load-dir", str(tmp_path / f"{name}-{fmt}"), "--save-dir", str(out), *flags])
        assert code == 0, capsys.readouterr().err
        exports[fmt] = read_hf(out)
    return exports


def test_dense_checkpoints_megatron_core_saved_export_bit_exact(hf_model_factory, tmp_path, capsys):
    models = {
        "llama": hf_model_factory("llama-3.1-8b", layers=4),
        "qwen2-tied": hf_model_factory("qwen2.5-7b-instruct", layers=4, tie_word_embeddings=True),
    }
    results = run_megatron_saves(tmp_path, models, Parallelism(tp=2, pp=2))
    for name, hf in models.items():
        original = read_hf(hf)
        produced, _ = results[name]
        assert produced == sorted(original), name
        for fmt, back in export_both_formats(tmp_path, name, hf, capsys).items():
            assert sorted(back) == sorted(original), (name, fmt)
            assert all(torch.equal(back[k], original[k]) for k in original), (name, fmt)
    # inspect reads the legacy per-rank files Megatron-LM wrote: their layout, and that they suit only it.
    capsys.readouterr()
    assert main(["inspect", "--json", str(tmp_path / "llama-legacy")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["family"]) == ("torch (legacy)", "llama")
    assert report["written_for"] == {"model_class": "gpt", "tp": 2, "pp": 2, "ep": 1, "etp": 2, "pipeline_split": []}
    assert report["suits"] == {"tp": [2], "pp": [2], "ep": [1]}
    assert report["vocab"]["stored_rows"] % (128 * 2) == 0 and report["vocab"]["stored_rows"] - report["vocab"]["size"] < 256


MOE_LAYOUTS = {
    "ep2": Parallelism(ep=2),
    "tp2-ep2-etp1": Parallelism(tp=2, ep=2, etp=1),
    "pp2-ep2": Parallelism(pp=2, ep=2),
    "tp2-ep2-etp2": Parallelism(tp=2, ep=2, etp=2),  # experts themselves split over TP ranks
}


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_checkpoints_megatron_core_saved_export_bit_exact(layout, hf_model_factory, tmp_path, capsys):
    """MoE as megatron-core saves it: expert-parallel shards, per-layer keys of mixed dense and MoE layers, a
    gated shared expert. Both formats export to what megatron-core itself says the model holds
    (gather_global_state, in HF names), which is the original; the live ranks hand out the same."""
    models = {"qwen2_moe-mixed-shared-expert": hf_model_factory("qwen1.5-moe-a2.7b", layers=4, mlp_only_layers=[0, 3])}
    if layout in ("ep2", "tp2-ep2-etp1"):  # 2 ranks; the 4-rank layouts run only the model that has it all
        models.update(qwen3_moe=hf_model_factory("qwen3-30b-a3b"), mixtral=hf_model_factory("mixtral-8x7b-v0.1"))
    results = run_megatron_saves(tmp_path, models, MOE_LAYOUTS[layout])
    for name, hf in models.items():
        config = json.loads((hf / "config.json").read_text())
        original = read_hf(hf)
        produced, megatron_state = results[name]
        assert produced == sorted(original), name
        megatron_view = mcore_to_hf_state_dict(megatron_state, config)
        assert sorted(megatron_view) == sorted(original), name
        for fmt, back in export_both_formats(tmp_path, name, hf, capsys).items():
            assert sorted(back) == sorted(original), (name, fmt)
            for k in original:
                assert torch.equal(back[k], megatron_view[k]) and torch.equal(back[k], original[k]), (name, fmt, k)


def test_multi_token_prediction_layers_are_handed_out_and_exported(hf_model_factory, tmp_path, capsys):
    """DeepSeek-V3 with its MTP layer (multi-latent attention, sigmoid routing with expert bias): the live ranks
    hand out every HF tensor, the MTP layer's included; Megatron-LM's legacy per-rank save (MLA's norms under
    the local spec's names, the MTP layer's experts numbered within each EP rank) and a torch_dist checkpoint
    whose args name the MTP layers export to the original, with --hf-config too (the HF config names MTP layers
    whether or not HF weights hold them)."""
    hf = Path(hf_model_factory("deepseek-v3", mtp=True))
    results = run_megatron_saves(tmp_path, {"deepseek": hf}, Parallelism(ep=2))
    original = read_hf(hf)
    assert any(".layers.2." in name for name in original)  # the MTP layer, after the model's 2
    produced, _ = results["deepseek"]
    assert produced == sorted(original)
    for source in ("deepseek-legacy", "deepseek-ours"):
        for flags in ([], ["--hf-config", str(hf)]):
            out = tmp_path / f"{source}-back{len(flags)}"
            assert main(["mcore-to-hf", "--load-dir", str(tmp_path / source), "--save-dir", str(out), *flags]) == 0, capsys.readouterr().err
            back = read_hf(out)
            assert sorted(back) == sorted(original), (source, flags)
            assert all(torch.equal(back[k], original[k]) for k in original), (source, flags)
