"""Who reads a pool's events: the thread waiting for them, else the receiving thread; in order,
none lost, across every hand-over between the two."""

import threading
import time

import pytest

from fsdp2nb.pool import event_reader
from fsdp2nb.pool.event_reader import EventReader
from fsdp2nb.pool.rank_events import RankEvents
from fsdp2nb.wire.channels import KernelChannels, RankChannels
from fsdp2nb.wire.events import StreamOutput
from fsdp2nb.wire.signing import KEY_BYTES, Signer
from tests.support.channels import wait_until


class _Pool:
    """A kernel end with its event reader, and one rank's end, on a Unix socket in `directory`."""

    def __init__(self, directory) -> None:
        signer = Signer(b"k" * KEY_BYTES)
        address = str(directory / "pool.sock")
        self.kernel = KernelChannels(signer, address)
        self.rank = RankChannels(signer, address, rank=0)
        self.events = RankEvents(ranks_to_join=1, on_exit=lambda event: None)
        self.sorted_on: list[str] = []
        sort = self.events.sort

        def sort_noting_thread(event):
            self.sorted_on.append(threading.current_thread().name)
            sort(event)

        self.events.sort = sort_noting_thread
        self.reader = EventReader(self.kernel, self.events)

    def send(self, text: str, cell_id: int | None = 1) -> None:
        self.rank.send_event(StreamOutput(rank=0, cell_id=cell_id, stream="stdout", text=text))

    def held_texts(self) -> list[str]:
        return [event.text for event in self.events.held_output.take()[0]]

    def close(self) -> None:
        self.reader.stop()
        self.rank.close()
        self.kernel.close()


@pytest.fixture
def pool(tmp_path):
    opened = _Pool(tmp_path)
    yield opened
    opened.close()


def _wait_for_texts(pool: _Pool, count: int, timeout_s: float = 10.0) -> list[str]:
    texts, deadline = [], time.monotonic() + timeout_s
    while len(texts) < count and time.monotonic() < deadline:
        event = pool.reader.next_event(0.1)
        if event is not None:
            texts.append(event.text)
    return texts


def test_a_waiting_thread_reads_its_events_itself(pool):
    pool.send("before", cell_id=None)
    assert wait_until(lambda: pool.sorted_on)  # the receiving thread reads, and sits in its poll again
    threading.Timer(0.2, pool.send, args=("late",)).start()
    pool.send("early")
    waiter = threading.current_thread().name
    assert _wait_for_texts(pool, 2) == ["early", "late"]
    assert pool.sorted_on[-1] == waiter  # sent while this thread waited: read here, not handed over


def test_the_receiving_thread_reads_while_no_thread_waits(pool):
    pool.send("between cells", cell_id=None)
    assert wait_until(lambda: pool.sorted_on)
    assert pool.sorted_on == ["fsdp2nb-receiver"]
    assert pool.held_texts() == ["between cells"]


def test_reading_goes_back_to_the_receiving_thread_once_the_waiter_stops_waiting(pool):
    assert pool.reader.next_event(0.01) is None  # the wait then blocks elsewhere (a prompt), not in next_event
    pool.send("while the waiter is at a prompt", cell_id=None)
    assert wait_until(lambda: pool.sorted_on, timeout_s=event_reader.STEP_ASIDE_S + 5)
    assert pool.sorted_on == ["fsdp2nb-receiver"]


def test_events_stay_in_order_and_whole_across_hand_overs(pool):
    sent = [f"line {index}" for index in range(300)]

    def send_all():
        for index, text in enumerate(sent):
            pool.send(text)
            if index % 2 == 0:
                time.sleep(0.01)

    sender = threading.Thread(target=send_all)
    sender.start()
    received: list[str] = []
    deadline = time.monotonic() + 30
    while len(received) < len(sent) and time.monotonic() < deadline:
        if len(received) % 50 == 25:  # away as at a prompt: the receiving thread takes over, then gives back
            time.sleep(event_reader.STEP_ASIDE_S * 3)
        event = pool.reader.next_event(0.1)
        if event is not None:
            received.append(event.text)
    sender.join()
    assert received == sent
    assert {"fsdp2nb-receiver", threading.current_thread().name} <= set(pool.sorted_on)


def test_stop_ends_the_receiving_thread_and_may_be_called_twice(pool):
    pool.reader.stop()
    pool.reader.stop()
    assert "fsdp2nb-receiver" not in {thread.name for thread in threading.enumerate()}
    pool.kernel.close()
    assert pool.reader.next_event(0.05) is None  # closed channels: nothing to read, no error
