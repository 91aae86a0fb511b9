"""Ranks get the CPU as torchrun's do: each in a scheduling group (session) of its own, and
an idle pool sleeps: the host agent and the ranks' request and control loops wait for something
to happen instead of polling. On a host with no core spare, every wake-up of these processes
takes a core from a training rank, and the other ranks wait for that one."""

import os
import time

import psutil

from fsdp2nb.worker.sampler import SAMPLE_INTERVAL_S

WINDOW_S = 2.0


def _wakeups(pid: int, thread_name: str) -> int:
    """Voluntary context switches (one per sleep) of a process's threads with that OS name."""
    total = 0
    for thread in psutil.Process(pid).threads():
        base = f"/proc/{pid}/task/{thread.id}"
        with open(f"{base}/comm") as comm, open(f"{base}/status") as status:
            if comm.read().strip() == thread_name:
                total += int(status.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


def test_the_agent_and_the_rank_loops_do_not_poll(pool):
    ranks = [info.pid for info in pool.ranks.values()]
    agent = psutil.Process(ranks[0]).ppid()
    time.sleep(1.0)  # past start-up
    before = {pid: _wakeups(pid, "python") for pid in [agent, *ranks]}
    time.sleep(WINDOW_S)
    after = {pid: _wakeups(pid, "python") for pid in [agent, *ranks]}
    assert after[agent] - before[agent] <= 1
    samples = WINDOW_S / SAMPLE_INTERVAL_S
    for pid in ranks:  # Python's threads share the OS name: only the sampler's wake-ups are allowed
        assert after[pid] - before[pid] <= samples + 2, "a rank thread other than the sampler woke up"


def test_each_rank_leads_a_session_of_its_own(pool):
    # With autogroup scheduling a session is a scheduling group: torchrun starts each rank in
    # its own, and ranks sharing one group would share its CPU share on a busy host.
    ranks = [info.pid for info in pool.ranks.values()]
    assert [os.getsid(pid) for pid in ranks] == ranks
