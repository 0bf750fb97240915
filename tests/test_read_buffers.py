"""The executors' read buffers are reused for reads of a fitting size, and large one-off ones are let go."""

from mconvert.converters.parallel import Buffers


def test_buffers_are_reused_for_reads_of_at_least_half_their_size():
    buffers = Buffers()
    first = buffers.take(1000)
    buffers.give_back([first])
    assert buffers.take(2000).ctypes.data != first.ctypes.data  # too small
    assert buffers.take(400).ctypes.data != first.ctypes.data  # would waste more than half
    assert buffers.take(600).ctypes.data == first.ctypes.data
    assert buffers.take(600).ctypes.data != first.ctypes.data  # taken: not handed out twice


def test_free_buffers_beyond_what_is_kept_are_let_go_largest_first():
    buffers = Buffers(keep_bytes=1500)
    small, large = buffers.take(1000), buffers.take(2000)
    buffers.give_back([small, large])
    assert buffers.take(2000).ctypes.data != large.ctypes.data
    assert buffers.take(1000).ctypes.data == small.ctypes.data


def test_some_rows_of_a_tensor_are_read_where_they_lie(tmp_path):
    """A section of a fused projection (`Rows`: rows [start, stop) of each of G groups) is read run by run into one
    buffer, and equals those rows of the whole tensor, into a reused buffer too."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from mconvert.dtypes import as_torch
    from mconvert.formats.hf_checkpoint import HFCheckpoint
    from mconvert.formats.safetensors import Rows

    fused = torch.arange(12 * 5, dtype=torch.bfloat16).reshape(12, 5)
    save_file({"before": torch.ones(3), "fused": fused}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    hf = HFCheckpoint(tmp_path)
    rows = Rows(groups=3, start=1, stop=3)
    expected = fused.reshape(3, 4, 5)[:, 1:3].reshape(6, 5)
    assert torch.equal(as_torch(hf.read("fused", rows)), expected)
    assert hf.nbytes("fused", rows) == expected.numel() * 2
    buffer = np.empty(1000, dtype=np.uint8)
    assert torch.equal(as_torch(hf.read("fused", rows, into=buffer)), expected)
