"""A failed allocation's report on a rank, the lines the notebook shows for it, and who sent a SIGKILL."""

from __future__ import annotations

import pytest

from fsdp2nb.frontend.memory_notes import shortage_lines, sigkill_line
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.records import ErrorInfo, MemoryShortage
from fsdp2nb.worker.forked_ranks import oom_killer_sent
from fsdp2nb.worker.memory_failure import requested_bytes, shortage_of

CPU_MESSAGE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
               "tried to allocate 10000000000000 bytes. Error code 12 (Cannot allocate memory)")
CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
                "which 10.50 GiB is free.")


@pytest.mark.parametrize(("message", "expected"), [
    (CPU_MESSAGE, 10**13),
    (CUDA_MESSAGE, 20 * 2**30),
    ("Unable to allocate 7.11 PiB for an array with shape (1000000000000000,)", int(7.11 * 2**50)),
    ("out of memory", None),
])
def test_the_size_asked_for_is_read_from_the_allocators_message(message, expected):
    assert requested_bytes(message) == expected


def test_a_failed_cpu_allocation_is_reported_and_other_errors_are_not():
    report = shortage_of(RuntimeError(CPU_MESSAGE))
    assert report is not None and report.device == "cpu" and report.requested_bytes == 10**13
    assert report.capacity_bytes and report.used_bytes > 0 and report.tracked is False
    assert shortage_of(RuntimeError("shapes do not match")) is None
    assert shortage_of(ValueError("x")) is None


def test_an_allocation_failure_behind_another_error_is_found():
    try:
        try:
            raise MemoryError()
        except MemoryError as error:
            raise RuntimeError("the data loader failed") from error
    except RuntimeError as outer:
        report = shortage_of(outer)
    assert report is not None and report.requested_bytes is None


def test_the_notes_say_what_was_asked_free_and_held_rank_by_rank():
    memory = MemoryShortage(device="cpu", requested_bytes=10**13, free_bytes=20 * 2**30, capacity_bytes=24 * 2**30,
                            used_bytes=400 * 2**20, tracked=True, param_bytes=2**20, grad_bytes=2**20,
                            optimizer_bytes=2 * 2**20)
    errors = [(2, ErrorInfo("RuntimeError", CPU_MESSAGE, (), memory=memory)), (0, ErrorInfo("ValueError", "x", ()))]
    assert shortage_lines(errors) == [
        "rank 2 ran out of memory: it asked for 9.09 TiB; the host had 20 GiB free of 24 GiB",
        "  rank 2 held 400 MiB resident (RSS): model parameters 1 MiB, gradients 1 MiB, "
        "optimizer state 2 MiB, other 396 MiB",
    ]
    untracked = MemoryShortage(device="cuda:0", requested_bytes=None, free_bytes=None, capacity_bytes=None,
                               used_bytes=2**30, tracked=False)
    lines = shortage_lines([(1, ErrorInfo("OutOfMemoryError", "", (), memory=untracked))])
    assert lines[0] == "rank 1 ran out of memory: the allocator did not say how much it asked for; cuda:0's free memory unknown"
    assert "it knows no model" in lines[1] and "fsdp2nb.load_model" in lines[1]


@pytest.mark.parametrize(("before", "after", "logged", "sent"), [
    (0, 1, None, True), (0, 0, None, False), (0, 0, True, True), (None, None, None, None),
    (None, None, False, False), (3, 3, False, False),
])
def test_the_oom_killer_is_named_from_its_count_or_the_kernel_log(before, after, logged, sent):
    assert oom_killer_sent(before, after, logged) is sent


def test_a_sigkill_line_says_who_sent_it():
    def died(oom_killer):
        return RankExited(rank=1, pid=9, exit_code=None, signal_name="SIGKILL", stderr_tail=(), oom_killer=oom_killer)

    assert "OOM killer sent it" in sigkill_line(died(True))
    assert "did not send it" in sigkill_line(died(False))
    assert "usual sender" in sigkill_line(died(None))
    assert sigkill_line(RankExited(rank=1, pid=9, exit_code=3, signal_name=None, stderr_tail=())) is None
