"""The executors' read buffers are reused for reads of a fitting size, and large one-off ones are let go."""

from mconvert.converters.parallel import Buffers


def test_buffers_are_reused_for_reads_of_at_least_half_their_size():
    buffers = Buffers()
    first = buffers.take(1000)
    buffers.give_back([first])
    assert buffers.take(2000).data_ptr() != first.data_ptr()  # too small
    assert buffers.take(400).data_ptr() != first.data_ptr()  # would waste more than half
    assert buffers.take(600).data_ptr() == first.data_ptr()
    assert buffers.take(600).data_ptr() != first.data_ptr()  # taken: not handed out twice


def test_free_buffers_beyond_what_is_kept_are_let_go_largest_first():
    buffers = Buffers(keep_bytes=1500)
    small, large = buffers.take(1000), buffers.take(2000)
    buffers.give_back([small, large])
    assert buffers.take(2000).data_ptr() != large.data_ptr()
    assert buffers.take(1000).data_ptr() == small.data_ptr()
