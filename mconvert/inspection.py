"""`mconvert inspect`: what a checkpoint holds (an HF directory, a torch_dist checkpoint, a legacy `torch` one or an FSDP save,
or another tool's save, found from its run folder as mcore-to-hf finds it), read from its headers and metadata only:
the family and model, the stored Megatron args, every tensor's shape, dtype and chunking, the vocabulary padding, the
layout it was written for and the ones it suits. A save whose model neither its args nor its tool's records describe
is reported by what it stores, with what it needs (`--hf-config`) to be read as a model."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from mconvert.converters.manifest import MANIFEST
from mconvert.errors import ConversionError
from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
from mconvert.mappings import get_mapping
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore import fsdp_dtensor
from mconvert.mcore.layout import OPTIMIZER_KEY
from mconvert.mcore.parallelism import Parallelism, padded_vocab_size
from mconvert.megatron_lm.args import parallelism_from_args
from mconvert.megatron_lm.flags import pipeline_split_flags

_MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
    "vocab_size", "max_position_embeddings", "rope_theta", "untie_embeddings", "qkv_bias", "qk_norm",
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.dtype):
        return str(value)
    return str(value)


def _model(spec: ModelSpec) -> dict[str, Any]:
    model = {name: getattr(spec, name) for name in _MODEL_FIELDS}
    if spec.moe is not None:
        model |= {"num_experts": spec.moe.num_experts, "moe_router_topk": spec.moe.top_k, "moe_ffn_hidden_size": spec.moe.ffn_hidden_size}
    if spec.layer_blocks is not None:  # one block a layer, as HybridModel's pattern names them
        model["layer_blocks"] = spec.layer_blocks
    if spec.mamba is not None:
        model |= {f"mamba_{name}": getattr(spec.mamba, name) for name in ("num_heads", "head_dim", "num_groups", "state_dim")}
    if spec.linear_attention is not None:
        la = spec.linear_attention
        model |= {
            "linear_attention_layers": "".join("L" if linear else "F" for linear in la.layers),
            "linear_num_key_heads": la.key_heads, "linear_num_value_heads": la.value_heads,
        }
    return model


def _fits(par: Parallelism, spec: ModelSpec) -> bool:
    try:
        par.validate(spec)
    except ConversionError:
        return False
    return True


def suitable_layouts(spec: ModelSpec, stored_vocab_rows: int | None = None, divisible_by: int = 128) -> dict[str, list[int]]:
    """The TP, PP and EP sizes (each with the others at 1) the model can be sharded by. With
    `stored_vocab_rows`, a TP must also pad the vocabulary to those rows, as Megatron-LM computes the
    embedding's shape from the TP it runs at and a torch_dist load of another shape fails."""
    powers = [2**k for k in range(7)]
    held_by = {"model_class": "hybrid"} if spec.layer_blocks is not None else {}  # what only HybridModel holds
    tps = [
        tp for tp in powers
        if _fits(Parallelism(tp=tp, etp=1 if spec.moe else None, **held_by), spec)
        and (stored_vocab_rows is None or padded_vocab_size(spec.vocab_size, Parallelism(tp=tp, make_vocab_size_divisible_by=divisible_by)) == stored_vocab_rows)
    ]
    pps = [pp for pp in range(1, spec.num_layers + 1) if _fits(Parallelism(pp=pp, **held_by), spec)]
    experts = spec.moe.num_experts if spec.moe else 1
    eps = [ep for ep in range(1, experts + 1) if _fits(Parallelism(ep=ep, etp=1 if spec.moe else None, **held_by), spec)]
    return {"tp": tps, "pp": pps, "ep": eps}


def _files(directory: Path) -> dict[str, Any]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return {"count": len(files), "bytes": sum(p.stat().st_size for p in files), "manifest": (directory / MANIFEST).exists()}


def inspect_hf(directory: Path) -> dict[str, Any]:
    config = read_hf_config(directory, "inspect")
    family, spec = get_mapping(config, source=str(directory / "config.json"))
    hf = HFCheckpoint(directory)
    return {
        "path": str(directory),
        "format": "hf",
        "family": family.name,
        "architecture": (config.get("architectures") or ["?"])[0],
        "dtype": str(spec.dtype),
        "model": _model(spec),
        "vocab": {"size": spec.vocab_size},
        "suits": suitable_layouts(spec),
        "tensors": [
            {"name": name, "shape": list(stored.shape), "dtype": str(stored.dtype), "file": stored.file.name}
            for name, stored in hf.tensors.items()
        ],
        "files": _files(directory),
    }


def stored_tensors(dcp: Any) -> list[dict[str, Any]]:
    """Every model tensor a torch_dist save stores, under its own key: shape, dtype and chunking."""
    tensors = []
    for key, shape in sorted(dcp.shapes.items()):
        if not OPTIMIZER_KEY.match(key):
            meta = dcp.metadata.state_dict_metadata[key]
            tensors.append({"name": key, "shape": list(shape), "dtype": str(meta.properties.dtype), "chunks": len(meta.chunks), "chunk_shape": list(meta.chunks[0].sizes)})
    return tensors


def find_save(path: Path, hf_config: Path | None) -> tuple[Any, Any, dict[str, Any] | None, str]:
    """The save under `path` as mcore-to-hf finds it (a tool's run folder included), its reader, the HF config that
    describes its model (`hf_config`, else the one its tool's records or stored args name; None where none does), and
    why none could be had (a record naming a folder that is not there)."""
    from mconvert.converters.mcore_sources import open_megatron_checkpoint
    from mconvert.converters.save_folders import config_in_args, find_run_save, named_config

    problem = ""
    try:
        run = find_run_save(path, config=hf_config is None)
    except ConversionError as error:  # a record names a model that is not here: say so, and read the rest
        run, problem = find_run_save(path, config=False), str(error)
    source = open_megatron_checkpoint(run.load_dir, run.iteration)
    if hf_config is None and not problem:
        try:
            run = named_config(run, config_in_args(source.args))
        except ConversionError as error:
            problem = str(error)
    config_dir = hf_config if hf_config is not None else run.config_dir
    return run, source, read_hf_config(Path(config_dir), "--hf-config") if config_dir is not None else None, problem


def inspect_megatron(load_dir: Path, hf_config: Path | None = None) -> dict[str, Any]:
    from mconvert.converters.mcore_sources import TorchDistTensors
    from mconvert.converters.mcore_to_hf import plan_export
    from mconvert.converters.wrapped_save import wrapped

    run, source, reference, problem = find_save(load_dir, hf_config)
    torch_dist = wrapped(source, TorchDistTensors)  # another tool's layout wraps it
    dcp = torch_dist.dcp if torch_dist is not None else None
    held = {"path": str(load_dir), "format": source.format, "iteration_dir": source.location, "tool": run.tool}
    if run.config_from:
        held["config_from"] = f"{run.config_dir} ({run.config_from})"
    if source.args is None and reference is None:
        records = f", and {run.tool}'s records name no HF model" if run.tool != "Megatron-LM" else ""
        why = problem or f"no Megatron-LM args describing the model are stored with it{records}"
        return held | {
            "needs": f"--hf-config HF_DIR (the HF folder or hub id of the model it was trained from): {why}",
            "tensors": stored_tensors(dcp) if dcp is not None else [],
            "files": _files(load_dir),
        }
    plan, config = plan_export(source, reference)
    spec, args = plan.spec, source.args
    shapes = source.stored_shapes(plan)
    # The layout the save was written for, where its args record it (a tool's save without args: its shapes are global).
    written_for = parallelism_from_args(args) if args is not None else plan.parallelism
    embedding_rows = shapes["embedding.word_embeddings.weight"][0]
    if dcp is not None:  # as stored (another tool's keys included: its vision tower, its fused tensors)
        tensors = stored_tensors(dcp)
    else:
        tensors = [{"name": key, "shape": list(shape)} for key, shape in sorted(shapes.items())]
    if source.format == "torch_dist":
        suits = suitable_layouts(spec, embedding_rows, written_for.make_vocab_size_divisible_by)
    elif source.format == fsdp_dtensor.FORMAT:
        # Each tensor whole, read by a Megatron-FSDP run at any TP its vocabulary padding allows and any EP (measured:
        # conversions for TP 2 and EP 2 run at 1); one pipeline stage.
        suits = suitable_layouts(spec, embedding_rows, written_for.make_vocab_size_divisible_by) | {"pp": [1]}
    else:
        # Megatron-LM loads the legacy per-rank format only at the layout it was saved with; a torch_dcp save is not
        # claimed for any layout but its own either.
        suits = {"tp": [written_for.tp], "pp": [written_for.pp], "ep": [written_for.ep]}
    return held | {
        "family": plan.family.name,
        "architecture": config["architectures"][0],
        "dtype": str(source.weights_dtype if source.weights_dtype is not None else spec.dtype),
        "model": _model(spec),
        "vocab": {
            "size": spec.vocab_size,
            "stored_rows": embedding_rows,
            "padding": embedding_rows - spec.vocab_size,
            "make_vocab_size_divisible_by": written_for.make_vocab_size_divisible_by,
        },
        "written_for": {
            "model_class": written_for.model_class,
            "tp": written_for.tp, "pp": written_for.pp, "ep": written_for.ep, "etp": written_for.expert_tp,
            # A HybridModel's pattern is its pipeline split.
            "pipeline_split": [f"--hybrid-layer-pattern {shlex.quote(args.hybrid_layer_pattern)}"]
            if written_for.model_class == "hybrid" else pipeline_split_flags(written_for.pipeline),
        } if args is not None else None,
        "suits": suits,
        "args": {k: _jsonable(v) for k, v in sorted(vars(args).items())} if args is not None else None,
        "tensors": tensors,
        "files": _files(load_dir),
    }


def inspect_path(path: Path, hf_config: Path | None = None) -> dict[str, Any]:
    """What the checkpoint at `path` holds, as a JSON-able dict (a Megatron save's model described by `hf_config`
    where given)."""
    if not path.is_dir():
        raise ConversionError(f"inspect {path}: not a directory")
    if (path / "config.json").exists():
        return inspect_hf(path)
    return inspect_megatron(path, hf_config)


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _tensor_lines(report: dict[str, Any]) -> list[str]:
    files = report["files"]
    lines = [f"files: {files['count']}, {files['bytes']} bytes, manifest: {'yes' if files['manifest'] else 'no'}"]
    lines.append(f"tensors ({len(report['tensors'])}):")
    for tensor in report["tensors"]:
        extra = [tensor["dtype"]] if "dtype" in tensor else []
        if "chunks" in tensor:
            extra.append(f"{tensor['chunks']} chunks of {_shape(tensor['chunk_shape'])}")
        if "file" in tensor:
            extra.append(tensor["file"])
        lines.append(f"  {tensor['name']}  {_shape(tensor['shape'])}  {'  '.join(extra)}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    saved_by = f" ({report['tool']}'s save in {report['iteration_dir']})" if report.get("tool", "Megatron-LM") != "Megatron-LM" else ""
    if "needs" in report:  # what it stores, and what it needs to be read as a model
        path = shlex.quote(report["path"])
        return "\n".join([
            f"{report['path']}: {report['format']} checkpoint{saved_by}, {len(report['tensors'])} model tensors; which model they are is not recorded",
            f"needs: {report['needs']}",
            f"then: mconvert inspect {path} --hf-config HF_DIR; mconvert mcore-to-hf --load-dir {path} --hf-config HF_DIR --save-dir OUT",
            *_tensor_lines(report),
        ])
    lines = [f"{report['path']}: {report['format']} checkpoint{saved_by}, {report['family']} ({report['architecture']}), {report['dtype']}"]
    if "config_from" in report:
        lines.append(f"config: {report['config_from']}")
    lines.append("model: " + ", ".join(f"{k}={v}" for k, v in report["model"].items()))
    vocab = report["vocab"]
    if "padding" in vocab:
        lines.append(
            f"vocab: {vocab['size']} tokens, stored as {vocab['stored_rows']} rows ({vocab['padding']} rows of padding, "
            f"to a multiple of {vocab['make_vocab_size_divisible_by']} x TP)"
        )
    else:
        lines.append(f"vocab: {vocab['size']} tokens")
    if "written_for" in report and report["written_for"] is None:
        lines.append("written for: not recorded (no Megatron-LM args stored)")
    elif "written_for" in report:
        w = report["written_for"]
        model = "HybridModel " if w["model_class"] == "hybrid" else ""
        lines.append(" ".join([f"written for: {model}TP={w['tp']} PP={w['pp']} EP={w['ep']} ETP={w['etp']}", *w["pipeline_split"]]))
    suits = report["suits"]
    lines.append("suits: " + "; ".join(f"{dim.upper()} in {{{', '.join(map(str, sizes))}}}" for dim, sizes in suits.items()))
    if report.get("args") is not None:
        lines.append(f"args: {len(report['args'])} stored (--json lists them)")
    return "\n".join(lines + _tensor_lines(report))


def run_inspect(path: Path, as_json: bool, check: bool, hf_config: Path | None = None) -> int:
    """The `inspect` command: print the report (or, with `check`, re-hash every file against the manifest)."""
    if check:
        from mconvert.converters.manifest import check_manifest, read_manifest

        count = len(read_manifest(path))
        problems = check_manifest(path)
        if as_json:
            print(json.dumps({"path": str(path), "files": count, "problems": problems}, indent=2))
        else:
            for problem in problems:
                print(f"{path}/{problem}")
            print(f"{path}: {count} files checked against {MANIFEST}: " + (f"{len(problems)} do not match" if problems else "all match"))
        return 1 if problems else 0
    report = inspect_path(path, hf_config)
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
