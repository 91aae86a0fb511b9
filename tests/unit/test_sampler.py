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
