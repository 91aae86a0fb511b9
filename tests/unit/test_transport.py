import hmac
import os
import pickle
import struct

import pytest

from fsdp2nb.wire.requests import RunCell
from fsdp2nb.wire.signing import KEY_BYTES, Signer
from tests.support.channels import ListLog, read_until, wait_until

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
    from fsdp2nb.wire import events, launch_plan, records, requests

    signer = Signer(b"k" * KEY_BYTES)
    messages = [
        requests.RunCell(cell_id=1, code="x", transformed="x\n", execution_count=3),
        events.CellFinished(rank=1, cell_id=2, status="error", error=records.ErrorInfo("E", "v", ("tb",))),
        requests.Shutdown(),
        launch_plan.RankPlan(rank=0, local_rank=0, device="cpu"),  # not a wire type: pickled whole
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

    def __init__(self, directory) -> None:
        import threading

        from fsdp2nb.wire.channels import KernelChannels, RankChannels

        self.signer = Signer(b"k" * KEY_BYTES)
        self.address = str(directory / "pool.sock")
        self.kernel = KernelChannels(self.signer, self.address)
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
        from fsdp2nb.wire.events import StreamOutput

        self.rank.send_event(StreamOutput(rank=0, cell_id=1, stream="stdout", text=text))

    def close(self) -> None:
        self.rank.close()  # first: ends a read that waits on the rank
        self._stop.set()
        self._reader.join()
        self.kernel.close()


def test_the_reader_delivers_events_in_the_order_they_were_sent(tmp_path):
    channels = _Channels(tmp_path)
    try:
        for text in ("a", "b", "c", "d", "e"):
            channels.send(text)
        assert wait_until(lambda: len(channels.background) == 5)
        assert channels.background == ["a", "b", "c", "d", "e"]
    finally:
        channels.close()


@pytest.mark.parametrize("key", [b"k" * KEY_BYTES, bytes(range(64)), bytes(range(200))])
def test_frames_carry_a_standard_hmac_sha256_of_their_payload(key):
    import hashlib
    import hmac

    signer = Signer(key)
    for value in (b"", b"x", bytes(range(256)) * 100):
        frame = signer.pack(value)
        assert frame[:32] == hmac.new(key, frame[32:], hashlib.sha256).digest()
        assert signer.unpack(frame) == value


def test_a_new_connection_wakes_the_reader_once_not_for_good(tmp_path):
    """The admitting thread wakes the reader through a pipe to register a new connection. The
    reader's epoll is level-triggered: a wake-up left unread would keep it ready, so that every
    later wait returned at once and the reader spun."""
    from fsdp2nb.wire.channels import RankChannels
    from fsdp2nb.wire.events import StreamOutput

    channels = _Channels(tmp_path)
    try:
        assert wait_until(lambda: channels.background_passes > 0)
        newcomer = RankChannels(channels.signer, channels.address, rank=1)  # wakes the reader
        newcomer.send_event(StreamOutput(rank=1, cell_id=1, stream="stdout", text="new"))
        assert wait_until(lambda: "new" in channels.background)  # registered: the reader was woken
        assert wait_until(lambda: channels.kernel._epoll.poll(0) == []), "the wake-up was never read"
        newcomer.close()
    finally:
        channels.close()


def test_a_signed_message_that_does_not_decode_is_dropped_not_raised():
    signer = Signer(b"k" * KEY_BYTES)
    frame = signer.pack(_Present())
    frame = frame[:32] + frame[32:].replace(b"_Present", b"_Missing")  # a class this end lacks
    frame = hmac.digest(b"k" * KEY_BYTES, frame[32:], "sha256") + frame[32:]  # signed again, validly
    assert signer.unpack(frame) is None
    assert signer.num_undecodable == 1 and signer.num_rejected == 0


class _Present:
    """Stands for a class that only the sending end can import."""


# --- connections the kernel must survive ------------------------------------------------------------


def _kernel_end(directory, **options):
    from fsdp2nb.wire.channels import KernelChannels

    log = ListLog()
    signer = Signer(b"k" * KEY_BYTES, log=log.logger)
    address = str(directory / "pool.sock")
    return KernelChannels(signer, address, log=log.logger, **options), signer, address, log


def _connect_raw(address: str):
    import socket

    from fsdp2nb.wire.framing import Link

    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(address)
    client.settimeout(10)
    return Link(client)


def _introduce(address: str, signer: Signer, role: str = "events", rank: int | None = 1):
    """A connection that answered its challenge with a signed hello; and the hello's frame."""
    from fsdp2nb.wire.protocol import ChannelHello

    link = _connect_raw(address)
    challenge = bytes(link.receive(max_bytes=512))[:32]  # then the kernel's wire version
    hello = signer.pack_versioned(ChannelHello(role=role, rank=rank, challenge=challenge))
    link.send(hello)
    return link, hello


def _stream(rank: int, text: str):
    from fsdp2nb.wire.events import StreamOutput

    return StreamOutput(rank=rank, cell_id=1, stream="stdout", text=text)


def _send_raw(link, data: bytes) -> None:
    import contextlib

    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused, and closed, meanwhile
        link.sock.sendall(data)


HOSTILE_FIRST_MESSAGES = {
    "a bad signature": lambda signer: Signer(b"f" * KEY_BYTES).pack(_Tripwire()),
    "a truncated frame": lambda signer: struct.pack("!Q", 200) + b"t" * 50,
    "a length prefix of 2**63": lambda signer: struct.pack("!Q", 2**63) + b"x" * 100,
    "random bytes": lambda signer: os.urandom(4000),
    "a signed message that is not a hello": lambda signer: signer.pack(_stream(1, "not a hello")),
}


@pytest.mark.parametrize("kind", HOSTILE_FIRST_MESSAGES)
def test_a_hostile_first_message_gets_one_log_line_and_nothing_else(tmp_path, kind):
    import tracemalloc

    kernel, signer, address, log = _kernel_end(tmp_path)
    try:
        tracemalloc.start()
        hostile = _connect_raw(address)
        _send_raw(hostile, HOSTILE_FIRST_MESSAGES[kind](signer))
        if kind == "a truncated frame":
            hostile.close()  # half a hello, then gone
        assert wait_until(lambda: log.matching("refused a connection"))
        _, peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak_bytes < 1024 * 1024, "memory was allocated by a claimed length"
        genuine, _ = _introduce(address, signer, rank=0)
        genuine.send(signer.pack(_stream(0, "genuine")))
        received = read_until(kernel, lambda r: r)
        assert [m.text for m in received] == ["genuine"]
        assert len(log.lines) == 1, log.lines
        assert UNPICKLED == []
        hostile.close()
        genuine.close()
    finally:
        kernel.close()


def test_a_replayed_hello_gets_nothing(tmp_path):
    kernel, signer, address, log = _kernel_end(tmp_path)
    try:
        first, recorded_hello = _introduce(address, signer, rank=1)
        recorded_event = signer.pack(_stream(1, "once"))
        first.send(recorded_event)
        assert [m.text for m in read_until(kernel, lambda r: r)] == ["once"]
        first.close()
        read_until(kernel, lambda r: ("events", 1) not in kernel._links)  # reading sees it closed
        assert ("events", 1) not in kernel._links  # so only the challenge can refuse the replay
        replayer = _connect_raw(address)  # the same user, without the key, resending what it saw
        _send_raw(replayer, struct.pack("!Q", len(recorded_hello)) + recorded_hello)
        _send_raw(replayer, struct.pack("!Q", len(recorded_event)) + recorded_event)
        assert wait_until(lambda: log.matching("replayed hello"))
        replayer.receive(max_bytes=512)  # its own challenge
        with pytest.raises((EOFError, ConnectionResetError)):  # closed by the kernel, the replayed event unread
            replayer.receive()
        genuine, _ = _introduce(address, signer, rank=1)
        genuine.send(signer.pack(_stream(1, "genuine")))
        assert [m.text for m in read_until(kernel, lambda r: r)] == ["genuine"]
        assert len(log.lines) == 1, log.lines
        replayer.close()
        genuine.close()
    finally:
        kernel.close()


def test_a_second_connection_for_a_connected_rank_is_refused_and_the_first_kept(tmp_path):
    from fsdp2nb.wire.channels import RankChannels

    kernel, signer, address, log = _kernel_end(tmp_path)
    first = RankChannels(signer, address, rank=0)
    try:
        kernel.send(0, RunCell(cell_id=1, code="first"))
        assert first.receive_request(10_000) == RunCell(cell_id=1, code="first")
        second = RankChannels(signer, address, rank=0)
        assert wait_until(lambda: len(log.matching("already has a")) == 3), log.lines
        kernel.send(0, RunCell(cell_id=2, code="still the first"))
        assert first.receive_request(10_000) == RunCell(cell_id=2, code="still the first")
        with pytest.raises(EOFError):  # the kernel closed the second one's connections
            second.receive_request(10_000)
        assert log.matching("rank 0 already has a requests connection")
        second.close()
    finally:
        first.close()
        kernel.close()


def test_a_connection_whose_peer_is_gone_can_be_replaced(tmp_path):
    from fsdp2nb.wire.channels import RankChannels

    kernel, signer, address, log = _kernel_end(tmp_path)
    try:
        RankChannels(signer, address, rank=0).close()
        assert wait_until(lambda: ("requests", 0) in kernel._links)
        gone = kernel._links[("requests", 0)]
        again = RankChannels(signer, address, rank=0)
        assert wait_until(lambda: kernel._links[("requests", 0)] is not gone)
        kernel.send(0, RunCell(cell_id=1, code="again"), connect_timeout_s=10)
        assert again.receive_request(10_000) == RunCell(cell_id=1, code="again")
        assert not log.matching("already has a requests connection")
        again.close()
    finally:
        kernel.close()


def test_a_sender_stopped_mid_frame_holds_up_no_other_and_is_reported_by_rank(tmp_path):
    stalled: list[tuple[int | None, float]] = []
    kernel, signer, address, log = _kernel_end(tmp_path, stalled_frame_s=0.3,
                                               on_stalled=lambda rank, s: stalled.append((rank, s)))
    healthy, _ = _introduce(address, signer, rank=0)
    stopped, _ = _introduce(address, signer, rank=1)
    try:
        frame = signer.pack(_stream(1, "finally whole"))
        packed = struct.pack("!Q", len(frame)) + frame
        stopped.sock.sendall(packed[:len(packed) // 2])  # then it stops, as a SIGSTOP would leave it
        received = read_until(kernel, lambda r: kernel._part_read)  # until the kernel holds the half frame
        healthy.send(signer.pack(_stream(0, "still heard")))
        received += read_until(kernel, lambda r: any(m.text == "still heard" for m in r))
        assert [m.text for m in received] == ["still heard"]
        read_until(kernel, lambda r: stalled, timeout_s=10)
        assert [rank for rank, _ in stalled] == [1] and stalled[0][1] >= 0.3
        assert log.matching("rank 1 stopped in the middle of a message")
        stopped.sock.sendall(packed[len(packed) // 2:])
        assert [m.text for m in read_until(kernel, lambda r: r)] == ["finally whole"]
        assert log.matching("rank 1 resumed")
    finally:
        healthy.close()
        stopped.close()
        kernel.close()


def test_frames_reassemble_from_pieces_of_any_size():
    import socket

    from fsdp2nb.wire.framing import FrameReader, Link

    left, right = socket.socketpair()
    right.setblocking(False)
    frames = [b"", b"x", bytes(range(256)) * 300, os.urandom(3 * 1024 * 1024), b"after"]
    data = b"".join(struct.pack("!Q", len(f)) + f for f in frames)
    reader, received = FrameReader(right), []
    for start in range(0, len(data), 77777):
        left.sendall(data[start:start + 77777])
        received += reader.read_available()
        assert reader.read_available() == []  # nothing more there: it does not wait
    assert received == frames and reader.stalled_since is None
    Link(left).send(b"y" * 10)
    left.close()
    assert reader.read_available() == [b"y" * 10]
    with pytest.raises(EOFError):
        reader.read_available()
    right.close()


def test_a_huge_length_prefix_allocates_nothing_by_its_claim():
    import socket
    import tracemalloc

    from fsdp2nb.wire.framing import FrameReader, FrameTooLong

    left, right = socket.socketpair()
    right.setblocking(False)
    left.sendall(struct.pack("!Q", 2**63) + b"z" * 1000)
    tracemalloc.start()
    reader = FrameReader(right)
    assert reader.read_available() == [] and reader.stalled_since is not None
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak_bytes < 1024 * 1024
    left.close()
    right.close()
    left, right = socket.socketpair()
    right.setblocking(False)
    left.sendall(struct.pack("!Q", 2**63))
    with pytest.raises(FrameTooLong, match="over the 4096 allowed"):  # where a limit is set, it is kept
        FrameReader(right, max_frame_bytes=4096).read_available()
    left.close()
    right.close()


def _admission(directory, **options):
    """An Admission on a socket in `directory` that admits every verified hello into a list."""
    import socket

    from fsdp2nb.wire.admission import Admission

    log = ListLog()
    signer = Signer(b"k" * KEY_BYTES)
    address = str(directory / "pool.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(128)
    admitted: list = []
    admission = Admission(server, signer, lambda hello, sock: admitted.append((hello, sock)), log.logger, **options)
    return admission, server, signer, address, log, admitted


def test_a_connection_without_a_hello_is_closed_at_its_deadline(tmp_path):
    admission, server, signer, address, log, admitted = _admission(tmp_path, hello_timeout_s=0.3)
    try:
        idle = _connect_raw(address)
        assert len(bytes(idle.receive(max_bytes=512))) > 32  # its challenge and version, then nothing
        with pytest.raises(EOFError):
            idle.receive()  # closed by the kernel
        assert wait_until(lambda: log.matching("sent no hello within 0.3 s")) and admission.num_pending == 0
        idle.close()
    finally:
        admission.close()
        server.close()


def test_waiting_connections_are_bounded_and_the_oldest_goes_first(tmp_path):
    admission, server, signer, address, log, admitted = _admission(tmp_path, max_pending=4)
    idle = []
    try:
        for _ in range(10):
            idle.append(_connect_raw(address))
            idle[-1].receive(max_bytes=512)  # greeted: it is pending now
        assert admission.num_pending == 4
        for link in idle[:6]:
            with pytest.raises(EOFError):
                link.receive()
        assert wait_until(lambda: len(log.matching("sent no hello before 4 newer connections came")) == 6)
        genuine, _ = _introduce(address, signer, rank=0)  # a rank still gets in
        assert wait_until(lambda: admitted) and admitted[0][0].rank == 0
        genuine.close()
    finally:
        for link in idle:
            link.close()
        admission.close()
        server.close()
    for _, sock in admitted:
        sock.close()


_ADMISSION_WITH_FEW_FDS = """
import logging, resource, socket, sys
from fsdp2nb.wire.admission import Admission
from fsdp2nb.wire.signing import Signer

log = logging.Logger("few-fds")
log.addHandler(logging.StreamHandler(sys.stdout))
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(128)
admission = Admission(server, Signer(b"k" * 32), lambda hello, sock: log.warning("admitted rank %s", hello.rank), log)
resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))
print("ready", flush=True)
sys.stdin.read()
"""


def test_out_of_file_descriptors_a_rank_still_gets_in(tmp_path):
    import subprocess
    import sys

    address = str(tmp_path / "pool.sock")
    server = subprocess.Popen([sys.executable, "-c", _ADMISSION_WITH_FEW_FDS, address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    idle = []
    try:
        assert _lines_until(server.stdout, "ready") == ["ready"]
        for _ in range(40):  # more than the server can hold open
            idle.append(_connect_raw(address))
        rank, _ = _introduce(address, Signer(b"k" * KEY_BYTES), rank=0)
        lines = _lines_until(server.stdout, "admitted rank 0")
        assert "admitted rank 0" in lines
        assert any("file descriptor was needed" in line for line in lines)
        assert not any("could not accept" in line for line in lines)
        rank.close()
    finally:
        for link in idle:
            link.close()
        server.kill()
        server.wait()


def _lines_until(stream, wanted: str, timeout_s: float = 30.0) -> list[str]:
    """Lines from `stream` (read unbuffered) until one is `wanted`, or none more come in time."""
    import select

    text = ""
    while wanted not in text.splitlines() and select.select([stream], [], [], timeout_s)[0]:
        piece = os.read(stream.fileno(), 65536)
        if not piece:
            break
        text += piece.decode()
    return text.splitlines()
