"""The executor's read buffers are reused for reads of a fitting size, and large one-off ones are let go."""

from mconvert.converters import hf_to_mcore
from mconvert.converters.hf_to_mcore import ReadBuffers


def test_buffers_are_reused_for_reads_of_at_least_half_their_size():
    buffers = ReadBuffers()
    first = buffers.take(1000)
    buffers.give_back([first])
    assert buffers.take(2000).data_ptr() != first.data_ptr()  # too small
    assert buffers.take(400).data_ptr() != first.data_ptr()  # would waste more than half
    assert buffers.take(600).data_ptr() == first.data_ptr()
    assert buffers.take(600).data_ptr() != first.data_ptr()  # taken: not handed out twice


def test_free_buffers_beyond_the_read_ahead_size_are_let_go_largest_first(monkeypatch):
    monkeypatch.setattr(hf_to_mcore, "READ_AHEAD_BYTES", 1500)
    buffers = ReadBuffers()
    small, large = buffers.take(1000), buffers.take(2000)
    buffers.give_back([small, large])
    assert buffers.take(2000).data_ptr() != large.data_ptr()
    assert buffers.take(1000).data_ptr() == small.data_ptr()
