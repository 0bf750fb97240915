"""`.metadata` as mconvert writes it (mconvert.formats.dcp_metadata: a pickle naming torch's classes, written without
importing torch's DCP package) against what torch's own classes and global save planning make of the same records:
unpickled, the two are equal field for field, chunk numbers and places included."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.formats.dcp_metadata import WrittenPart, write_metadata
from mconvert.mcore.checkpoint import RELEASE
from mconvert.mcore.parallelism import Parallelism


def torchs_metadata(parts: list[WrittenPart], declared: dict) -> Metadata:
    """The Metadata torch's DCP makes of every rank's plan (DefaultSavePlanner's global step), with the places."""
    plans, stored = [], {}
    for part in parts:
        items = []
        for key, offsets, shape, place in part.chunks:
            dtype, size = declared[key]
            index = MetadataIndex(key, torch.Size(offsets))
            chunk = ChunkStorageMetadata(index.offset, torch.Size(shape))
            items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=TensorWriteData(chunk, TensorProperties(dtype=dtype), torch.Size(size))))
            stored[index] = _StorageInfo(*place)
        for key, place in part.objects:
            index = MetadataIndex(key)
            items.append(WriteItem(index, WriteItemType.BYTE_IO))
            stored[index] = _StorageInfo(*place)
        plans.append(SavePlan(items))
    plans, metadata = create_default_global_save_plan(plans)
    metadata.storage_data = {item.index: stored[item.index] for plan in plans for item in plan.items}
    metadata.version = "1.0.0"
    return metadata


def values(obj) -> dict:
    """A dataclass's fields as a reader gets them (a field a pickle leaves out reads as its default)."""
    return {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)}


def fields(metadata: Metadata) -> dict:
    """Everything a reader sees, in order: each entry's fields, and each stored item's index (with its chunk number,
    which MetadataIndex's equality leaves out) and place."""
    return {
        "entries": [(key, type(meta).__name__, values(meta)) for key, meta in metadata.state_dict_metadata.items()],
        "properties": [meta.properties.__getstate__() for meta in metadata.state_dict_metadata.values()
                       if isinstance(meta, TensorStorageMetadata)],
        "storage": [(values(index), values(info)) for index, info in metadata.storage_data.items()],
        "rest": values(metadata),
    }


def written(tmp_path, parts: list[WrittenPart], declared: dict) -> Metadata:
    write_metadata(tmp_path, parts, declared)
    return pickle.loads((tmp_path / ".metadata").read_bytes())


def test_two_ranks_records_with_large_places_and_objects(tmp_path):
    declared = {"w": (torch.bfloat16, (4, 6)), "b": (torch.float32, (6,)), "e": (torch.float8_e4m3fn, (2, 3, 5))}
    parts = [
        WrittenPart(chunks=[("w", (0, 0), (2, 6), ("__0_0.distcp", 0, 100)), ("b", (0,), (6,), ("__0_0.distcp", 100, 7 << 31)),
                            ("e", (0, 0, 0), (1, 3, 5), ("__0_1.distcp", 0, 300))],
                    objects=[("w._extra_state/shard_0_1", ("__0_0.distcp", 200, 10))]),
        WrittenPart(chunks=[("w", (2, 0), (2, 6), ("__1_0.distcp", (1 << 40) + 3, 100)), ("e", (1, 0, 0), (1, 3, 5), ("__1_0.distcp", 1, 2))],
                    objects=[]),
    ]
    ours, torchs = written(tmp_path, parts, declared), torchs_metadata(parts, declared)
    assert ours == torchs and fields(ours) == fields(torchs)
    # The comparison sees the chunk numbers: numbered across tensors instead of within each, it fails.
    index, info = next((i, v) for i, v in ours.storage_data.items() if i.fqn == "w" and i.index == 1)
    del ours.storage_data[index]
    ours.storage_data[MetadataIndex("w", index.offset, 4)] = info
    assert ours == torchs and fields(ours) != fields(torchs)


@pytest.mark.parametrize("layout", [Parallelism(tp=2), Parallelism(tp=2, ep=2, pp=2)], ids=["tp2", "tp2ep2pp2"])
def test_a_conversions_metadata_is_what_torchs_planner_makes(hf_model_factory, tmp_path, layout):
    hf = hf_model_factory("qwen3-30b-a3b", layers=2)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=layout, workers=2)
    ours = pickle.loads((tmp_path / "mcore" / RELEASE / ".metadata").read_bytes())
    # The records it was written from, read back from it: every chunk and object with its place, in the file's order.
    chunks = [(i.fqn, tuple(i.offset), tuple(next(c.sizes for c in ours.state_dict_metadata[i.fqn].chunks if c.offsets == i.offset)),
               (v.relative_path, v.offset, v.length)) for i, v in ours.storage_data.items() if i.offset is not None]
    objects = [(i.fqn, (v.relative_path, v.offset, v.length)) for i, v in ours.storage_data.items() if i.offset is None]
    declared = {key: (meta.properties.dtype, tuple(meta.size)) for key, meta in ours.state_dict_metadata.items()
                if isinstance(meta, TensorStorageMetadata)}
    assert len(chunks) > len(declared) and objects
    torchs = torchs_metadata([WrittenPart(chunks, objects)], declared)
    assert fields(written(tmp_path, [WrittenPart(chunks, objects)], declared)) == fields(torchs) == fields(ours)


def test_chunks_that_do_not_cover_a_tensor_write_nothing(tmp_path):
    declared = {"x": (torch.float32, (4, 2))}
    with pytest.raises(AssertionError, match=r"'x': chunks cover 4 of 8 elements"):
        write_metadata(tmp_path, [WrittenPart([("x", (0, 0), (2, 2), ("__0_0.distcp", 0, 16))], [])], declared)
    assert not (tmp_path / ".metadata").exists()
