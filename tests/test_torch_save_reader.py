"""torch.save's files read without torch (mconvert.formats.pickles): what torch itself saves, tensors as numpy arrays
holding torch.load's bytes (bf16 and float8 as ml_dtypes', views into larger storages, parameters, storages shared
between tensors, a record inside a larger file as DCP stores it), and claims past a storage's bytes refused."""

import argparse
import io

import numpy as np
import pytest
import torch

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.formats.pickles import StoredObject, load_megatron_file

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.uint8, torch.bool]


def saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def same(array: np.ndarray, tensor: torch.Tensor) -> bool:
    return (array.dtype == dtypes.dtype_of(tensor.dtype) and array.shape == tuple(tensor.shape)
            and np.ascontiguousarray(array).tobytes() == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_reads_as_torch_load_reads_it(dtype, tmp_path):
    whole = (torch.randn(6, 5) * 4).to(dtype)
    value = {"whole": whole, "view": whole[1:4, 2:], "transposed": whole.t(), "scalar": whole[0, 0],
             "parameter": torch.nn.Parameter(whole.float()), "empty": whole[:0], "dtype": dtype}
    path = tmp_path / "saved.pt"
    path.write_bytes(b"x" * 100 + saved(value) + b"y" * 10)  # a record inside a larger file, as in a DCP data file
    read = load_megatron_file(path, "here", 100, path.stat().st_size - 110)
    loaded = torch.load(io.BytesIO(saved(value)))
    assert read.keys() == loaded.keys() and read["dtype"] == dtypes.dtype_of(dtype)
    for key in ("whole", "view", "transposed", "scalar", "parameter", "empty"):
        assert same(read[key], loaded[key]), key
    assert np.shares_memory(read["whole"], read["view"])  # one storage, read once


def test_megatron_args_read_with_stand_ins(tmp_path):
    args = argparse.Namespace(params_dtype=torch.bfloat16, num_layers=2, device=torch.device("cpu"), seen={1, 2}, raw=b"\x00\xff")
    path = tmp_path / "common.pt"
    path.write_bytes(saved({"args": args, "iteration": 3}))
    read = load_megatron_file(path, "common.pt")
    assert read["iteration"] == 3 and read["args"].params_dtype == dtypes.bfloat16 and read["args"].seen == {1, 2}
    assert read["args"].raw == b"\x00\xff" and isinstance(read["args"].device, StoredObject)


class _Runs:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_tensor_past_its_storage_and_an_unknown_global_are_refused(tmp_path):
    data = bytearray(saved(torch.arange(8, dtype=torch.float32)))
    claim = data.index(b"K\x08")  # BININT1 8, the storage's element count, then its tensor's size
    size = data.index(b"K\x08", claim + 1)
    data[size + 1] = 9  # a tensor of 9 elements in a storage of 8
    path = tmp_path / "past.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match="not a readable torch.save file .*past its storage"):
        load_megatron_file(path, "past.pt")
    path.write_bytes(saved({"value": _Runs()}))
    with pytest.raises(ConversionError, match="holds objects of builtins.print"):
        load_megatron_file(path, "runs.pt")
