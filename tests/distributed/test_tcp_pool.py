"""The multi-host path of a pool on one host: TLS over TCP, rank 0's TCPStore, a watched connection.

A launcher that starts the usual local agent but has the kernel listen on 127.0.0.1 makes the
plan a multi-host one, so every part that ranks on other hosts use runs here, with no namespaces
and no Ray: the certificate check, the store address passed on through the kernel, gloo on the
interface of the cluster address, and an agent that ends its ranks when its connection ends.
"""

import time

import psutil
import pytest

from fsdp2nb.pool.launcher import LocalLauncher
from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import CellFinished, RankExited, StreamOutput
from fsdp2nb.wire.requests import RunCell

pytest.importorskip("cryptography", reason="multi-host pools need `pip install cryptography`")


class LoopbackTcpLauncher(LocalLauncher):
    """The local agent, reached over TCP with TLS as an agent on another host would be."""

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        return "tcp://127.0.0.1:0"


@pytest.fixture(scope="module")
def tcp_pool():
    pool = WorkerPool(PoolSpec(devices=("cpu", "cpu")), launcher=LoopbackTcpLauncher())
    pool.start()
    yield pool
    pool.stop()


def _run(pool, cell_id, code) -> str:
    pool.send((0, 1), RunCell(cell_id=cell_id, code=code))
    outputs, finished = [], 0
    while finished < pool.world_size:
        event = pool.next_event(60)
        assert event is not None and not isinstance(event, RankExited), event
        if isinstance(event, StreamOutput):
            outputs.append(f"[{event.rank}] {event.text}")
        if isinstance(event, CellFinished):
            assert event.status == "ok", event.error
            finished += 1
    return "".join(sorted(outputs))


def test_ranks_meet_through_rank_zeros_store_and_speak_over_tls(tcp_pool):
    output = _run(tcp_pool, 1, "import os\nx = torch.ones(1)\ndist.all_reduce(x)\n"
                               "print(int(x.item()), os.environ['MASTER_ADDR'], os.environ['GLOO_SOCKET_IFNAME'])")
    assert output == "[0] 2 127.0.0.1 lo\n[1] 2 127.0.0.1 lo\n"
    assert all(info.address == "127.0.0.1" for info in tcp_pool.ranks.values())
    assert tcp_pool.rank_process_state(0) == "remote"  # never looked up by pid on this host


def test_the_store_listens_on_the_cluster_address_only(tcp_pool):
    rank_zero = psutil.Process(tcp_pool.ranks[0].pid)
    listening = [c.laddr.ip for c in rank_zero.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) == {"127.0.0.1"}, listening


def test_an_agent_whose_kernel_connection_ends_ends_its_ranks():
    pool = WorkerPool(PoolSpec(devices=("cpu", "cpu")), launcher=LoopbackTcpLauncher())
    pool.start()
    try:
        ranks = [psutil.Process(info.pid) for info in pool.ranks.values()]
        agent = psutil.Process(pool._launched.process_ids()[0])
        pool._channels.close()  # as if the kernel's host went away: the agent's link ends
        gone, alive = psutil.wait_procs([agent, *ranks], timeout=30)
        assert alive == [], alive
    finally:
        pool.stop(polite=False)


def test_a_wrong_certificate_fingerprint_stops_the_start_plainly():
    class WrongFingerprint(LoopbackTcpLauncher):
        def launch(self, plan, key):
            import dataclasses

            return super().launch(dataclasses.replace(plan, tls_fingerprint="0" * 64), key)

    pool = WorkerPool(PoolSpec(devices=("cpu",)), launcher=WrongFingerprint())
    started = time.monotonic()
    with pytest.raises(Exception, match="exited while starting"):
        pool.start(timeout_s=60)
    assert time.monotonic() - started < 60
    assert pool.state == "stopped"
