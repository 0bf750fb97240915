"""torch.save's records as mconvert writes them without torch (mconvert.formats.torch_save): torch.load reads every
dtype a conversion writes, in every shape, at any size (zip64 past 4 GiB), and the objects beside them."""

import argparse
import io
import zipfile

import numpy as np
import pytest
import torch

from mconvert import dtypes
from mconvert.formats.torch_save import (
    STORAGE_CLASSES,
    saved_bytes,
    saved_tensor_layout,
    tensor_data_start,
    tensor_pickle,
    tensor_record,
)


@pytest.mark.parametrize("name", sorted(STORAGE_CLASSES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 1, 5)])
def test_torch_load_reads_each_dtype_and_shape(name, shape, tmp_path):
    dtype = dtypes.BY_NAME[name]
    values = np.random.default_rng(0).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if name == "bool":
        values &= 1
    head, tail = tensor_record(dtype, shape)
    path = tmp_path / "record"
    path.write_bytes(b"before" + head + values.tobytes() + tail)  # as in a DCP data file: records back to back
    loaded = torch.load(io.BytesIO(head + values.tobytes() + tail))
    assert loaded.dtype == dtypes.torch_dtype(dtype) and tuple(loaded.shape) == shape
    assert bytes(loaded.reshape(-1).view(torch.uint8).numpy()) == values.tobytes()
    assert tensor_data_start(path, len(b"before"), len(head) + values.size + len(tail)) == len(head)
    assert len(head) % 64 == 0  # torch.save's storages start 64-byte aligned, for torch.load's mmap
    entries = zipfile.ZipFile(io.BytesIO(head + values.tobytes() + tail)).namelist()
    assert entries == ["archive/data.pkl", "archive/.format_version", "archive/.storage_alignment", "archive/byteorder",
                       "archive/data/0", "archive/version", "archive/.data/serialization_id"]
    pickled = zipfile.ZipFile(io.BytesIO(head + values.tobytes() + tail)).read("archive/data.pkl")
    assert saved_tensor_layout(pickled)[1:] == (dtype, 0, shape, torch.empty(shape).stride())


def test_a_record_past_4_gib_has_zip64_fields_torch_reads(tmp_path):
    """A storage of 4 GiB and more (an fp32 embedding of a large vocabulary at TP 1) and the members after it, whose
    places pass 4 GiB: zip64 sizes and places, as torch.save writes them (a sparse file: nothing is held)."""
    size = (1 << 32) + 100
    head, tail = tensor_record(dtypes.uint8, (size,))
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(head)
        f.seek(size, io.SEEK_CUR)
        f.write(b"\x07" * 0)
        f.write(tail)
    with zipfile.ZipFile(path) as archive:
        places = {info.filename.split("/", 1)[1]: (info.header_offset, info.file_size) for info in archive.infolist()}
        assert archive.read("archive/version") == b"3\n"
    assert places["data/0"][1] == size and places["version"][0] > size
    loaded = torch.load(path, mmap=True)
    assert loaded.shape == (size,) and loaded.dtype == torch.uint8 and int(loaded[-1]) == 0
    assert tensor_data_start(path, 0, path.stat().st_size) == len(head)


def test_objects_are_read_back_as_saved():
    """common.pt's dict and the empty `_extra_state` beside the tensors: torch.load makes of them what torch.save
    was given; numpy's dtypes are stored as torch's of the same name (what Megatron-LM's args hold)."""
    args = argparse.Namespace(num_layers=2, rotary_base=1e6, params_dtype=dtypes.bfloat16, spec=None,
                              window_size=(127, 0), names=["a", "b"], big=1 << 40, negative=-3)
    loaded = torch.load(io.BytesIO(saved_bytes({"args": args, "checkpoint_version": 3.0})), weights_only=False)
    assert loaded["checkpoint_version"] == 3.0
    assert vars(loaded["args"]) == {**vars(args), "params_dtype": torch.bfloat16}
    (empty,) = torch.load(io.BytesIO(saved_bytes([tensor_pickle(dtypes.uint8, (0,))], [b""])), weights_only=True)
    assert empty.dtype == torch.uint8 and empty.shape == (0,)
    with pytest.raises(TypeError, match="no pickle of"):
        saved_bytes({"args": argparse.Namespace(path=object())})
