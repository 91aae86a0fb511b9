"""A profiled cell's profile on the rank: the profiler runs on past the cell and its profile is
sent only by `send_after_reply`, which the rank calls once its reply is sent."""

import torch

from fsdp2nb.worker.profiling import ProfileSink, recording, send_after_reply


def _sink(sent: list, cell_id: list) -> ProfileSink:
    return ProfileSink(rank=0, device="cpu", send_event=sent.append, current_cell_id=lambda: cell_id[0])


def test_a_cells_profile_waits_for_send_after_reply_and_keeps_its_cell_id():
    sent: list = []
    cell_id = [7]
    with recording(_sink(sent, cell_id), True, after_reply=True):
        torch.ones(16).cumsum(0)
    assert sent == [] and torch.autograd._profiler_enabled()  # still recording: the reply goes first
    cell_id[0] = None  # the rank has left the cell when it replies
    send_after_reply()
    assert not torch.autograd._profiler_enabled()
    (profile,) = sent
    assert profile.cell_id == 7 and "aten::cumsum" in profile.names


def test_a_failing_cells_profile_is_still_sent_after_the_reply():
    sent: list = []
    try:
        with recording(_sink(sent, [3]), True, after_reply=True):
            torch.ones(4).cumprod(0)
            raise ValueError("late")
    except ValueError:
        pass
    assert sent == []
    send_after_reply()
    assert [profile.cell_id for profile in sent] == [3] and "aten::cumprod" in sent[0].names


def test_send_after_reply_without_a_profiled_cell_sends_nothing_and_the_next_profile_records():
    send_after_reply()
    sent: list = []
    with recording(_sink(sent, [1]), True):  # a block: sent when it ends
        torch.ones(4).sum()
    assert len(sent) == 1


def test_a_profile_the_rank_cannot_make_is_sent_as_a_failure_and_ends_the_kernels_wait(monkeypatch):
    from fsdp2nb.frontend.profiles import ProfileCollector
    from fsdp2nb.worker import profiling

    def broken(*args, **kwargs):
        raise RuntimeError("no events")

    sent: list = []
    with recording(_sink(sent, [5]), True, after_reply=True):
        torch.ones(4).sum()
    monkeypatch.setattr(profiling, "rank_profile", broken)
    send_after_reply()
    (failed,) = sent
    assert failed.cell_id == 5 and failed.failure == "RuntimeError: no events" and not failed.ops
    collector = ProfileCollector()
    pending = collector.expect(5, (0,))
    collector.hear(failed)
    collector.wait_for(pending, exited=lambda: ())  # returns: the failure counts as the rank's answer
    assert pending.profile is None
    assert pending.note() == "the profile is missing for rank 0: RuntimeError: no events"
