"""What mconvert writes, read back by the torch this runs under (scripts/checks/torch_versions.sh runs it under the
oldest and the newest torch the project claims, in environments with only torch, numpy, safetensors, ml_dtypes and
megatron-core): torch's DCP reader into preallocated tensors, `torch.load` of common.pt, megatron-core's
`dist_checkpointing.load`, tensor for tensor against what mconvert meant to write. The state-dict API (torch tensors
in memory, from the same plan) gives what was meant for each torch_dist save, and takes it back to the source;
every save (fsdp_dtensor too) is also read through mconvert's own reader, and exported back equal to its source.

The sources are random tensors of each HF name and shape the family's plan reads (no transformers needed), bf16 at
about 0.1. The fault injection corrupts one written tensor's values and shows the check names it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.converters.plan import build_plan
from mconvert.converters.state_dict import hf_to_mcore_state_dict, mcore_to_hf_state_dict
from mconvert.dtypes import as_torch, torch_dtype
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mappings import get_mapping
from mconvert.mcore.checkpoint import iteration_dir, read_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import real_config, shrink

# name: (config, shrink options, layout, format)
CASES = {
    "dense": ("llama-3.1-8b", {}, Parallelism(tp=2), "torch_dist"),
    "moe-ep": ("qwen3-30b-a3b", {}, Parallelism(tp=2, ep=2), "torch_dist"),
    # MLA, MoE with EP and a multi-token prediction layer.
    "mla-mtp": ("deepseek-v3", {}, Parallelism(tp=2, ep=2), "torch_dist"),
    "hybrid": ("nemotron-3-nano-30b-a3b", {"layers": 7, "hybrid_override_pattern": "M-M*EME"}, Parallelism(tp=2, ep=2, model_class="hybrid"), "torch_dist"),
    "fsdp-dtensor": ("qwen3-8b", {}, Parallelism(), "fsdp_dtensor"),
}


def make_source(config: dict, out, model_class: str = "gpt") -> dict[str, torch.Tensor]:
    """A random HF checkpoint of `config` in `out`: every tensor the family's plan reads, in the dtype the plan
    stores it in (bf16; a router's expert bias fp32, as the hub has it)."""
    family, spec = get_mapping(config)
    plan = build_plan(family, spec, Parallelism(model_class=model_class))
    dtypes = {ref.name: plan.dtype_of(piece) for piece in plan.pieces for ref in piece.sources}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in plan.hf_shapes().items():
        values = torch.randn(shape, generator=generator)
        tensors[name] = (values * 0.1 if len(shape) > 1 else values * 0.5 + 1.0).to(torch_dtype(dtypes[name]))
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return tensors


@dataclasses.dataclass
class Converted:
    config: dict
    source: dict[str, torch.Tensor]
    save: object  # the iteration directory
    layout: Parallelism
    format: str


@pytest.fixture(scope="module", params=CASES)
def converted(request, tmp_path_factory) -> Converted:
    name, options, layout, ckpt_format = CASES[request.param]
    options = dict(options)
    config = shrink(real_config(name), layers=options.pop("layers", 2), **options)
    work = tmp_path_factory.mktemp(request.param)
    source = make_source(config, work / "hf", layout.model_class)
    convert_hf_to_mcore(work / "hf", work / "mcore", parallelism=layout, ckpt_format=ckpt_format)
    return Converted(config, source, iteration_dir(work / "mcore"), layout, ckpt_format)


class ObjectsKept(DefaultLoadPlanner):
    """torch's default load planner, keeping the objects it loads (`load` puts them in a copy of the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, object] = {}

    def load_bytes(self, read_item, value) -> None:
        super().load_bytes(read_item, value)
        value.seek(0)
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


def read_with_torch(save) -> dict[str, object]:
    """Every entry of the save, read by torch's DCP reader: tensors into preallocated ones of the metadata's shape and
    dtype, objects as its default planner loads them."""
    reader = dcp.FileSystemReader(str(save))
    metadata = reader.read_metadata()
    state = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[key] = torch.full(tuple(entry.size), float("nan")).to(entry.properties.dtype)
        else:
            assert isinstance(entry, BytesStorageMetadata)
            state[key] = None
    objects = {key for key, value in state.items() if value is None}
    planner = ObjectsKept()
    dcp.load(state, storage_reader=reader, planner=planner)  # newer torch puts the objects in `state` too, older only in a copy
    assert planner.objects.keys() == objects
    return {**state, **planner.objects}


def differing(read: dict[str, object], meant: dict[str, torch.Tensor]) -> list[str]:
    """The keys of `meant` that `read` lacks or holds with another shape, dtype or value."""
    return sorted(
        key for key, tensor in meant.items()
        if not isinstance(read.get(key), torch.Tensor) or read[key].dtype != tensor.dtype or not torch.equal(read[key], tensor)
    )


def meant_by_the_state_dict_api(converted: Converted) -> dict[str, torch.Tensor]:
    return hf_to_mcore_state_dict(converted.source, converted.config, parallelism=converted.layout)


def test_torchs_dcp_reader_reads_every_tensor_as_mconvert_meant(converted):
    read = read_with_torch(converted.save)
    tensors = {key: value for key, value in read.items() if isinstance(value, torch.Tensor)}
    ours = DCPCheckpoint(converted.save)
    assert tensors.keys() == ours.shapes.keys()
    assert differing(read, {key: as_torch(ours.read_region(key, (0,) * len(shape), shape)) for key, shape in ours.shapes.items()}) == []
    if converted.format == "torch_dist":
        meant = meant_by_the_state_dict_api(converted)
        assert meant.keys() == tensors.keys()
        assert differing(read, meant) == []


def test_the_common_state_loads_with_torch(converted):
    """torch_dist's common.pt through `torch.load`; fsdp_dtensor keeps it in the DCP save, as objects."""
    if converted.format == "torch_dist":
        common, args = torch.load(converted.save / "common.pt", weights_only=False, map_location="cpu"), read_args(converted.save)
    else:
        common, args = read_with_torch(converted.save), DCPCheckpoint(converted.save).read_object("args")
    # mconvert's own reader gives the args' params_dtype as numpy's dtype, torch's as torch's.
    ours = {**vars(args), "params_dtype": torch.bfloat16}
    assert vars(common["args"]) == ours
    assert common["args"].tensor_model_parallel_size == converted.layout.tp
    assert common["args"].expert_model_parallel_size == converted.layout.ep


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """One gloo rank, as megatron-core's loader runs in a training job."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_megatron_cores_dist_checkpointing_load_reads_every_tensor(converted, process_group):
    if converted.format != "torch_dist":
        pytest.skip("Megatron-FSDP loads fsdp_dtensor through torch's DCP reader (above)")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    meant = meant_by_the_state_dict_api(converted)
    sharded = {key: ShardedTensor.from_rank_offsets(key, torch.empty_like(tensor)) for key, tensor in meant.items()}
    loaded = dist_checkpointing.load(sharded, str(converted.save))
    assert differing(loaded, meant) == []


def test_the_way_back_gives_the_source(converted, tmp_path):
    convert_mcore_to_hf(converted.save.parent, tmp_path / "back")
    back = {key: value for path in sorted((tmp_path / "back").glob("*.safetensors")) for key, value in load_file(path).items()}
    assert back.keys() == converted.source.keys()
    assert differing(back, converted.source) == []
    if converted.format == "torch_dist":
        again = mcore_to_hf_state_dict(meant_by_the_state_dict_api(converted), converted.config)
        assert again.keys() == converted.source.keys() and differing(again, converted.source) == []


def test_a_corrupted_tensor_is_named(tmp_path):
    """The fault: one value of a written tensor changed in its data file, where torch's reader finds it."""
    config = shrink(real_config("llama-3.1-8b"))
    source = make_source(config, tmp_path / "hf")
    layout = Parallelism(tp=2)
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", parallelism=layout)
    save = iteration_dir(tmp_path / "mcore")
    key = "decoder.final_layernorm.weight"
    reader = dcp.FileSystemReader(str(save))
    stored = next(info for index, info in reader.read_metadata().storage_data.items() if index.fqn == key)
    data = save / stored.relative_path
    original = DCPCheckpoint(save).read_region(key, (0,), (64,))
    raw = bytearray(data.read_bytes())
    record = raw[stored.offset : stored.offset + stored.length]
    at = stored.offset + bytes(record).index(original.tobytes())  # the values, within the record
    raw[at : at + 2] = np.asarray([-3.0], dtype=original.dtype).tobytes()
    data.write_bytes(bytes(raw))
    meant = hf_to_mcore_state_dict(source, config, parallelism=layout)
    assert differing(read_with_torch(save), meant) == [key]
    shutil.rmtree(tmp_path / "mcore")
