"""The pool's socket is private and only signed peers get heard."""

import contextlib
import os
import socket
import stat
import struct

from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import RankExited, StreamOutput
from fsdp2nb.wire.framing import Link
from fsdp2nb.wire.protocol import ChannelHello
from fsdp2nb.wire.requests import RunCell
from fsdp2nb.wire.signing import Signer


def _run(pool, cell_id, code):
    for rank in range(pool.world_size):
        pool.send(rank, RunCell(cell_id=cell_id, code=code))
    outputs, finished = [], 0
    while finished < pool.world_size:
        event = pool.next_event(30)
        assert event is not None and not isinstance(event, RankExited)
        if isinstance(event, StreamOutput):
            outputs.append(event.text)
        finished += type(event).__name__ == "CellFinished"
    return "".join(outputs)


def test_runtime_directory_is_private(pool):
    runtime_dir = pool._runtime_dir
    assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(os.path.join(runtime_dir, "pool.sock")).st_mode)


def test_a_peer_without_the_key_is_not_heard(pool):
    forger = Signer(os.urandom(32))
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(os.path.join(pool._runtime_dir, "pool.sock"))
    link = Link(client)  # the pool's own framing: only the signature can give the forger away
    challenge = bytes(link.receive(max_bytes=512))[:32]  # then the kernel's wire version
    link.send(forger.pack_versioned(ChannelHello(role="events", rank=None, challenge=challenge)))
    # The pool drops the connection once the hello fails verification, which may be before this
    # send (then it fails with EPIPE); either way the forged line must not reach the notebook.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        link.send(forger.pack(StreamOutput(rank=0, cell_id=1, stream="stdout", text="forged\n")))
    output = _run(pool, 1, "print('genuine')")
    assert "genuine" in output and "forged" not in output
    link.close()


def test_ranks_and_agent_listen_on_no_network_address(pool):
    import psutil

    (agent_pid,) = pool._launched.process_ids()
    agent = psutil.Process(agent_pid)
    processes = [agent, *agent.children(recursive=True)]
    assert len(processes) == pool.world_size + 1
    listening = [c.laddr for p in processes for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert all(address.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for address in listening), listening


def _pool_log_lines(pool) -> list[str]:
    with open(os.path.join(pool.log_dir, "pool.log")) as log:
        return log.read().splitlines()


def _wait_for(condition, timeout_s: float = 30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not (result := condition()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


def _connect(pool) -> Link:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(os.path.join(pool._runtime_dir, "pool.sock"))
    client.settimeout(30)
    return Link(client)


def _framed(frame: bytes) -> bytes:
    return struct.pack("!Q", len(frame)) + frame


def test_hostile_connections_each_get_one_log_line_and_the_pool_goes_on(pool):
    import threading

    genuine_signer = pool._channels._signer  # what a real peer signs with, for the replay below
    recorder = _connect(pool)
    challenge = bytes(recorder.receive(max_bytes=512))[:32]
    recorded_hello = genuine_signer.pack_versioned(ChannelHello(role="events", rank=7, challenge=challenge))
    recorder.send(recorded_hello)
    recorded_event = genuine_signer.pack(StreamOutput(rank=0, cell_id=2, stream="stdout", text="replayed\n"))
    hostile = {
        "bad signature": _framed(Signer(os.urandom(32)).pack_versioned(
            ChannelHello(role="events", rank=0, challenge=b""))),
        "truncated": struct.pack("!Q", 300) + b"t" * 100,
        "length 2**63": struct.pack("!Q", 2**63) + b"x" * 100,
        "random bytes": os.urandom(2000),
        "replayed hello": _framed(recorded_hello) + _framed(recorded_event),
    }
    lines_before, threads_before = len(_pool_log_lines(pool)), threading.active_count()
    for number, (kind, data) in enumerate(hostile.items(), start=1):
        link = _connect(pool)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            link.sock.sendall(data)
        if kind == "truncated":
            link.close()
        assert _wait_for(lambda n=number: len(_pool_log_lines(pool)) >= lines_before + n), kind
        assert len(_pool_log_lines(pool)) == lines_before + number, (kind, _pool_log_lines(pool)[lines_before:])
        link.close()
    new_lines = _pool_log_lines(pool)[lines_before:]
    assert all("refused a connection to the pool" in line for line in new_lines), new_lines
    assert "replayed hello" in new_lines[-1]
    assert threading.active_count() <= threads_before
    output = _run(pool, 2, "print('genuine')")
    assert "genuine" in output and "replayed" not in output
    recorder.close()


def test_a_rank_stopped_mid_frame_holds_up_no_other_rank_and_is_named():
    import signal

    from fsdp2nb.wire.events import CellFinished

    stalling = WorkerPool(PoolSpec(devices=("cpu", "cpu")), stalled_frame_s=1.0)
    stalling.start()
    code = (
        "import gc, os, psutil, signal, struct, time\n"
        "pids = [None] * world_size\n"
        "dist.all_gather_object(pids, os.getpid())\n"
        "if rank == 1:  # half a frame on its events connection, then stopped as by kill -STOP\n"
        "    events = next(o for o in gc.get_objects() if type(o).__name__ == 'RankChannels')._events\n"
        "    with events.lock:\n"
        "        events.sock.sendall(struct.pack('!Q', 1000) + b'half')\n"
        "        os.kill(os.getpid(), signal.SIGSTOP)\n"
        "else:\n"
        "    while psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED:\n"
        "        time.sleep(0.01)\n"
        "    time.sleep(0.3)  # the kernel has had the half frame\n"
        "    print('rank 0 goes on', flush=True)\n"
    )
    try:
        stalling.mark_busy((0, 1))  # as the session marks the ranks a cell runs on
        stalling.send((0, 1), RunCell(cell_id=1, code=code))
        events = []
        while not (any(isinstance(e, CellFinished) and e.rank == 0 for e in events)
                   and any(e.rank == 1 and "stopped" in getattr(e, "text", "") for e in events)):
            event = stalling.next_event(60)
            assert event is not None, f"events so far: {events}"
            events.append(event)
        lines = {(e.rank, e.cell_id, e.stream, e.text) for e in events if isinstance(e, StreamOutput)}
        assert (0, 1, "stdout", "rank 0 goes on\n") in lines
        (notice,) = [text for rank, cell_id, stream, text in lines if rank == 1 and cell_id == 1 and stream == "stderr"]
        assert notice.startswith("fsdp2nb: rank 1 stopped in the middle of sending a message")
        assert any("rank 1 stopped in the middle of a message" in line for line in _pool_log_lines(stalling))
    finally:
        with contextlib.suppress(KeyError, ProcessLookupError):
            os.kill(stalling.ranks[1].pid, signal.SIGKILL)
        stalling.stop(polite=False)
