import pickle

import pytest

from fsdp2nb.wire.protocol import RunCell
from fsdp2nb.wire.signing import KEY_BYTES, Signer

UNPICKLED = []


class _Tripwire:
    """Unpickling this records that it happened: a forged message must never get that far."""

    def __reduce__(self):
        return (UNPICKLED.append, ("unpickled",))


def test_round_trip_with_the_same_key():
    signer = Signer(b"k" * 32)
    assert signer.unpack(signer.pack(RunCell(cell_id=3, code="x"))) == RunCell(cell_id=3, code="x")


def test_forged_or_tampered_messages_are_dropped_unread():
    signer, forger = Signer(b"k" * 32), Signer(b"f" * 32)
    assert signer.unpack(forger.pack(_Tripwire())) is None
    frame = signer.pack(RunCell(cell_id=1, code="x"))
    assert signer.unpack(frame[:32] + pickle.dumps(_Tripwire())) is None
    assert signer.unpack(frame[:20]) is None
    assert UNPICKLED == [] and signer.num_rejected == 3


def test_short_keys_are_refused():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        Signer(b"short")


def test_messages_keep_their_type_and_fields_through_a_frame():
    from fsdp2nb.wire import protocol

    signer = Signer(b"k" * KEY_BYTES)
    messages = [
        protocol.RunCell(cell_id=1, code="x", transformed="x\n", execution_count=3),
        protocol.CellFinished(rank=1, cell_id=2, status="error", error=protocol.ErrorInfo("E", "v", ("tb",))),
        protocol.Shutdown(),
        protocol.RankPlan(rank=0, local_rank=0, device="cpu"),  # not a wire type: pickled whole
    ]
    for message in messages:
        received = signer.unpack(signer.pack(message))
        assert type(received) is type(message) and received == message


def test_frames_of_every_size_arrive_whole():
    import socket
    import threading

    from fsdp2nb.wire.framing import Link

    left, right = socket.socketpair()
    sender, receiver = Link(left), Link(right)
    frames = [b"", b"x", bytes(range(256)) * 300, b"y" * (3 * 1024 * 1024)]  # past the socket buffer
    writer = threading.Thread(target=lambda: [sender.send(frame) for frame in frames])
    writer.start()
    assert [bytes(receiver.receive()) for _ in frames] == frames
    writer.join()
    sender.send(b"z" * 11)
    with pytest.raises(OSError, match="over the 10 allowed"):
        receiver.receive(max_bytes=10)
    receiver.close()  # the rest of that frame is unread: the link is done


def test_a_closed_connection_ends_reading():
    import socket

    from fsdp2nb.wire.framing import Link

    left, right = socket.socketpair()
    sender, receiver = Link(left), Link(right)
    sender.send(b"last")
    sender.close()
    assert bytes(receiver.receive()) == b"last"
    with pytest.raises(EOFError):
        receiver.receive()
    receiver.close()


class _Channels:
    """A kernel end and one rank's end on a socket in `directory`, with a background reader."""

    def __init__(self, directory, kernel_class=None) -> None:
        import threading

        from fsdp2nb.wire.channels import KernelChannels, RankChannels

        self.signer = Signer(b"k" * KEY_BYTES)
        self.address = str(directory / "pool.sock")
        self.kernel = (kernel_class or KernelChannels)(self.signer, self.address)
        self.rank = RankChannels(self.signer, self.address, rank=0)
        self.background: list[str] = []
        self.background_passes = 0
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_in_background)
        self._reader.start()

    def _read_in_background(self) -> None:
        while not self._stop.is_set():
            self.kernel.receive(20, lambda message: self.background.append(message.text))
            self.background_passes += 1

    def send(self, text: str) -> None:
        from fsdp2nb.wire.protocol import StreamOutput

        self.rank.send_event(StreamOutput(rank=0, cell_id=1, stream="stdout", text=text))

    def close(self) -> None:
        self.rank.close()  # first: ends a read that waits on the rank
        self._stop.set()
        self._reader.join()
        self.kernel.close()


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_thread_reading_events_itself_takes_over_in_order_and_the_background_reader_sleeps(tmp_path):
    import time

    channels = _Channels(tmp_path)
    here: list[str] = []
    try:
        for text in ("a", "b", "c"):
            channels.send(text)
        with channels.kernel.reading_here():
            read_before = len(channels.background)
            channels.send("d")
            channels.send("e")
            _wait_until(lambda: channels.kernel.receive_here(100, lambda m: here.append(m.text))
                        or len(channels.background) + len(here) >= 5)
            time.sleep(0.1)  # the background reader had its chance to read something and did not
            assert len(channels.background) == read_before
        assert channels.background + here == ["a", "b", "c", "d", "e"]
        channels.send("f")
        _wait_until(lambda: len(channels.background) > read_before)
        assert channels.background[-1] == "f"  # reading went back to the background thread
    finally:
        channels.close()


@pytest.mark.parametrize("key", [b"k" * KEY_BYTES, bytes(range(64)), bytes(range(200))])
def test_signatures_are_standard_hmac_sha256(key):
    import hashlib
    import hmac

    from fsdp2nb.wire.signing import HmacSha256

    mac = HmacSha256(key)
    for payload in (b"", b"x", bytes(range(256)) * 100):
        assert mac.sign(payload) == hmac.new(key, payload, hashlib.sha256).digest()


def test_a_connection_made_while_another_thread_reads_does_not_wake_the_background_reader_for_good(tmp_path):
    import time

    from fsdp2nb.wire.channels import RankChannels
    from fsdp2nb.wire.protocol import StreamOutput

    channels = _Channels(tmp_path)
    try:
        assert _wait_until(lambda: channels.background_passes > 0)
        with channels.kernel.reading_here():
            newcomer = RankChannels(channels.signer, channels.address, rank=1)  # wakes the background
            passes = channels.background_passes
            time.sleep(0.5)
            # 20 ms waits give about 25 passes; a reader woken for good would make thousands
            assert channels.background_passes - passes < 100
            newcomer.send_event(StreamOutput(rank=1, cell_id=1, stream="stdout", text="new"))
            here: list[str] = []
            assert _wait_until(lambda: channels.kernel.receive_here(100, lambda m: here.append(m.text)) or here)
            assert here == ["new"]
        newcomer.close()
    finally:
        channels.close()


def test_a_background_wait_that_spans_a_handoff_does_not_read_a_link_emptied_meanwhile(tmp_path):
    import threading
    import time

    from fsdp2nb.wire.channels import KernelChannels

    class SlowToResume(KernelChannels):
        """The background reader loses the CPU between its wait and its read, on request."""

        delay_s = 0.0

        def _wait_ready(self, epoll, timeout_ms):
            ready = super()._wait_ready(epoll, timeout_ms)
            if ready and epoll is self._background:
                time.sleep(self.delay_s)
            return ready

    channels = _Channels(tmp_path, SlowToResume)
    try:
        assert _wait_until(lambda: channels.background_passes > 0)
        channels.kernel.delay_s = 0.3
        channels.send("a")
        time.sleep(0.05)  # the background reader saw it ready and is held up
        here: list[str] = []
        with channels.kernel.reading_here():
            assert _wait_until(lambda: channels.kernel.receive_here(100, lambda m: here.append(m.text)) or here)
        time.sleep(0.4)  # the background reader resumes with what it saw before the handoff
        entered = threading.Event()

        def next_request() -> None:
            with channels.kernel.reading_here():
                entered.set()

        threading.Thread(target=next_request, daemon=True).start()
        assert entered.wait(5), "the next request could not take over reading"
        assert here == ["a"] and channels.background == []
    finally:
        channels.close()


def test_a_signed_message_that_does_not_decode_is_dropped_not_raised():
    signer = Signer(b"k" * KEY_BYTES)
    frame = signer.pack(_Present())
    frame = frame[:32] + frame[32:].replace(b"_Present", b"_Missing")  # a class this end lacks
    frame = signer._mac.sign(frame[32:]) + frame[32:]
    assert signer.unpack(frame) is None
    assert signer.num_undecodable == 1 and signer.num_rejected == 0


class _Present:
    """Stands for a class that only the sending end can import."""
