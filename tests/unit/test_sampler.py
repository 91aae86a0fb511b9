"""The resource sampler keeps going when a reading fails, and says why once."""

import logging
import threading

from fsdp2nb.worker.sampler import ResourceSampler


def test_a_failed_reading_is_logged_once_and_sampling_goes_on(caplog):
    attempts: list[int] = []
    third_attempt = threading.Event()

    def send(snapshot) -> None:  # a RankSnapshot
        attempts.append(1)
        if len(attempts) >= 3:
            third_attempt.set()
        raise OSError("the events connection is closed")

    sampler = ResourceSampler(0, "cpu", send, is_busy=lambda: False, interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="fsdp2nb.worker.sampler"):
        sampler.start()
        assert third_attempt.wait(30)
        sampler.stop()
    failures = [r for r in caplog.records if "resource reading failed" in r.getMessage()]
    assert len(failures) == 1
    assert "the events connection is closed" in caplog.text


def test_flush_sends_what_the_request_logged_and_nothing_otherwise():
    """The rank's main thread flushes before each reply: a snapshot when points wait, none when
    nothing a snapshot tells has changed (an empty cell sends no extra message)."""
    from fsdp2nb.metrics import log, process_metrics

    process_metrics().drain()
    sent: list = []
    sampler = ResourceSampler(1, "cpu", sent.append, is_busy=lambda: False)  # not started: no timer
    sampler.flush()
    assert sent == []
    log(3, loss=0.5)
    sampler.flush()
    assert [[(p.step, p.values) for p in s.metrics] for s in sent] == [[(3, {"loss": 0.5})]]
    sampler.flush()
    assert len(sent) == 1


def test_flush_on_rank_0_sends_a_checkpointer_it_began_tracking():
    from fsdp2nb.checkpoint import tracking

    class Tracked:
        def status(self):
            from fsdp2nb.wire.records import CheckpointStatus

            return CheckpointStatus(directory="/ckpt", latest_step=None, saving_step=None, last_error=None, entries=())

    sent: list = []
    sampler = ResourceSampler(0, "cpu", sent.append, is_busy=lambda: False)
    sampler.flush()  # whatever this process tracked before: reported once
    sent.clear()
    checkpointer = Tracked()
    tracking.set_tracked(checkpointer)
    try:
        sampler.flush()
        sampler.flush()
    finally:
        tracking.clear_tracked(checkpointer)
    assert [s.checkpoint.status.directory for s in sent] == ["/ckpt"]
