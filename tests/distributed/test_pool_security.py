"""The pool's socket is private and only signed peers get heard."""

import contextlib
import os
import socket
import stat

import pytest

from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.framing import Link
from fsdp2nb.wire.protocol import ChannelHello, RankExited, RunCell, StreamOutput
from fsdp2nb.wire.signing import Signer


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(PoolSpec(devices=("cpu", "cpu")))
    pool.start()
    yield pool
    pool.stop()
    pool.stop()


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
    challenge = bytes(link.receive(max_bytes=64))
    link.send(forger.pack(ChannelHello(role="events", rank=None, challenge=challenge)))
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
