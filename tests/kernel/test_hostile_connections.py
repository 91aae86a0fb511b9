"""Connections to the pool's socket that are not ranks: the notebook never hears of them, and
the kernel spends no thread and few file descriptors on them."""

import contextlib
import os
import socket
import struct
import time

import psutil

MAX_PENDING = 64  # fsdp2nb.wire.admission.MAX_PENDING

NUM_CONNECTIONS = 2000


def _pool_paths(kernel) -> tuple[str, str]:
    run = kernel.execute("import fsdp2nb\npool = fsdp2nb._session.pool\nprint(pool._runtime_dir, pool.log_dir)")
    runtime_dir, log_dir = run.stdout.split()
    return os.path.join(runtime_dir, "pool.sock"), os.path.join(log_dir, "pool.log")


def _flood(address: str, count: int) -> list[socket.socket]:
    """`count` connections held open: every other one idle, the rest sending a frame of junk."""
    connections = []
    for index in range(count):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connections.append(client)
        client.connect(address)  # blocking: waits while the listen backlog is full
        client.settimeout(10)
        if index % 2:
            with contextlib.suppress(OSError):  # refused, and closed, meanwhile
                client.sendall(struct.pack("!Q", 64) + os.urandom(64))
    return connections


def _num_refused(log_path: str) -> int:
    with open(log_path) as log:
        return sum("refused a connection to the pool" in line for line in log)


def test_a_flood_of_junk_connections_never_reaches_the_notebook(kernel):
    address, log_path = _pool_paths(kernel)
    assert kernel.execute("%%fsdp2 --cpu 2\npass").status == "ok"
    kernel_process = psutil.Process(kernel.pid)
    threads_before, fds_before = kernel_process.num_threads(), kernel_process.num_fds()
    running = kernel.submit("import time\ntime.sleep(2)")  # a cell runs while they come
    connections = _flood(address, NUM_CONNECTIONS)
    try:
        threads_during, fds_during = kernel_process.num_threads(), kernel_process.num_fds()
        during = kernel.collect(running)
        empty = kernel.execute("%%fsdp2\npass")
        assert threads_during <= threads_before + 1, (threads_before, threads_during)
        assert fds_during <= fds_before + MAX_PENDING + 8, (fds_before, fds_during)
        assert during.status == "ok" and empty.status == "ok"
        shown = [m["content"] for m in [*during.messages, *empty.messages, *kernel.other_messages]
                 if m["msg_type"] in ("stream", "error", "display_data")]
        assert shown == []
        deadline = time.monotonic() + 60
        while _num_refused(log_path) < NUM_CONNECTIONS - MAX_PENDING and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _num_refused(log_path) >= NUM_CONNECTIONS - MAX_PENDING
    finally:
        for client in connections:
            client.close()
    assert kernel.execute("%%fsdp2\nprint('after')").stdout == "[all] after\n"


def test_a_rank_stopped_in_the_middle_of_a_message_is_named_in_the_cell(kernel):
    code = (
        "%%fsdp2\nimport gc, os, psutil, signal, struct, time\n"
        "pids = [None] * world_size\n"
        "dist.all_gather_object(pids, os.getpid())\n"
        "if rank == 1:  # half a message on its events connection, then stopped as by kill -STOP\n"
        "    events = next(o for o in gc.get_objects() if type(o).__name__ == 'RankChannels')._events\n"
        "    with events.lock:\n"
        "        events.sock.sendall(struct.pack('!Q', 1000) + b'half')\n"
        "        os.kill(os.getpid(), signal.SIGSTOP)\n"
        "while psutil.Process(pids[1]).status() != psutil.STATUS_STOPPED:\n"
        "    time.sleep(0.01)\n"
        "for tick in range(100):\n"
        "    print('tick', tick, flush=True)\n"
        "    time.sleep(0.5)\n"
    )
    run = kernel.execute_and_interrupt(code, when_printed="rank 1 stopped in the middle")
    shown = "".join(m["content"]["text"] for m in run.messages if m["msg_type"] == "stream")
    assert "[0] tick 0\n" in shown  # rank 0 was heard while rank 1 stood still mid-message
    assert "[1] fsdp2nb: rank 1 stopped in the middle of sending a message" in shown
    assert run.status == "error" and "state was lost" in run.traceback_text  # it never came back
    assert kernel.execute("%%fsdp2\nprint('fresh')").stdout == "[all] fresh\n"
