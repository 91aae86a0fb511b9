"""fsdp2nb's processes on test hosts (network namespaces): finding them, killing a host's agent
in the middle of a cell, and waiting until none is left (or one has ended)."""

from __future__ import annotations

import signal
import time

import psutil


def runs_module(process: psutil.Process, module: str) -> bool:
    """Whether `process` is `python -m module` (or forked from one: a rank is its agent's fork)."""
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    return command[1:3] == ["-m", module]


def pool_processes(hosts) -> list[psutil.Process]:
    """fsdp2nb's own processes (driver, agents and ranks forked from them) in the hosts' namespaces."""
    found = []
    for host in hosts:
        for pid in host.pids():
            try:
                process = psutil.Process(pid)
                if (runs_module(process, "fsdp2nb.worker.agent") or runs_module(process, "fsdp2nb.pool.ray_driver")) \
                        and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.Error:
                pass
    return found


def host_agents(hosts) -> list[psutil.Process]:
    """The agents among `pool_processes`: not forked from another agent, as ranks are."""
    return [process for process in pool_processes(hosts) if runs_module(process, "fsdp2nb.worker.agent")
            and not runs_module(process.parent(), "fsdp2nb.worker.agent")]


def kill_host_one_agent_mid_cell(kernel, hosts):
    """SIGKILL host 1's agent once a cell of all_reduces is under way on every rank; the cell's run."""
    agents = host_agents(hosts[1:])
    assert len(agents) == 1
    submitted = kernel.submit("%%fsdp2\nimport time\nfor i in range(600):\n"
                              "    x = torch.ones(1)\n    dist.all_reduce(x)\n"
                              "    if i == 1:\n        print('under way', flush=True)\n    time.sleep(0.05)")
    kernel.messages_for(submitted, lambda messages: any(
        message["msg_type"] == "stream" and "under way" in message["content"]["text"] for message in messages))
    agents[0].send_signal(signal.SIGKILL)
    return kernel.collect(submitted, timeout=180)


def wait_for_no_pool_processes(hosts, timeout_s: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := pool_processes(hosts)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def wait_until_ended(pid: int, timeout_s: float = 60.0) -> None:
    """Until `pid` has ended: gone, or a zombie (it waits only for its parent to collect it, which
    `psutil.wait_procs` would wait out for a process the test did not start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs after {timeout_s:.0f} s")
