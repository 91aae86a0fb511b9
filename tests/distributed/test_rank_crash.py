"""A rank that crashes in C code says where: every thread's Python stack reaches its exit report."""

from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.requests import RunCell


def test_a_segfault_in_a_rank_reports_the_python_stacks_of_its_threads(pool):
    pool.send(1, RunCell(cell_id=1, code="import ctypes\ndef crash_here():\n    ctypes.string_at(0)\ncrash_here()"))
    while not isinstance(event := pool.next_event(60), RankExited):
        assert event is not None, "rank 1 did not die"
    assert event.rank == 1 and event.signal_name == "SIGSEGV"
    tail = "\n".join(event.stderr_tail)
    assert "Fatal Python error: Segmentation fault" in tail and "crash_here" in tail, tail

