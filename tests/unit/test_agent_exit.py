"""How the pool words a host agent's end, whichever launcher reported it."""

import pytest

from fsdp2nb.pool.launcher import AgentExit
from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import HostOptions, PoolSpec, multi_host_spec


class _Ended:
    """A launch whose agent has ended as `ended` says."""

    def __init__(self, ended: AgentExit) -> None:
        self.ended = ended

    def agent_exit(self) -> AgentExit:
        return self.ended


def _broken_reason(spec: PoolSpec, ended: AgentExit, lost: dict[int, str] | None = None) -> str:
    pool = WorkerPool(spec)
    pool._launched, pool.state = _Ended(ended), "ready"
    for node, host in (lost or {}).items():
        pool._agent_lost(node, host)
    assert not pool.check_agent() and pool.state == "broken"
    return pool.broken_reason


@pytest.fixture
def two_hosts():
    return multi_host_spec(HostOptions(ray="auto", num_nodes=2, cpu_per_node=2), gpus=None, cpu=None,
                           collective_timeout_s=60.0)


def test_a_local_agent_is_named_by_its_pid():
    reason = _broken_reason(PoolSpec(devices=("cpu", "cpu")), AgentExit("killed by SIGKILL", pid=41))
    assert reason == "the host agent (pid 41) killed by SIGKILL; its ranks ended with it"


def test_a_remote_agent_is_named_by_host_node_and_ranks(two_hosts):
    reason = _broken_reason(two_hosts, AgentExit("was killed by SIGKILL", node=1, host="10.0.0.2"))
    assert reason.startswith("the host agent on host 10.0.0.2 (node 1, ranks 2, 3) was killed by SIGKILL")


def test_the_connection_that_ended_names_the_host_a_launcher_cannot(two_hosts):
    reason = _broken_reason(two_hosts, AgentExit("ended, and with it the srun step"), lost={1: "10.0.0.2"})
    assert reason.startswith("the host agent on host 10.0.0.2 (node 1, ranks 2, 3) ended, and with it")


def test_agents_that_ended_together_are_not_pinned_on_one_host(two_hosts):
    ended = AgentExit("ended with the Ray driver (killed by SIGKILL)", every_host=True)
    reason = _broken_reason(two_hosts, ended, lost={0: "10.0.0.1"})
    assert reason.startswith("every host's agent ended with the Ray driver (killed by SIGKILL)")


class _EndsLater:
    """A launch whose agent is seen to end only on the `after`-th look: a rank's connection broke
    first (the agent was ending its ranks), and the agent's exit is reaped a moment later."""

    def __init__(self, ended: AgentExit, after: int) -> None:
        self.ended, self.looks_left = ended, after

    def agent_exit(self) -> AgentExit | None:
        self.looks_left -= 1
        return self.ended if self.looks_left <= 0 else None


def test_a_request_that_meets_a_broken_pipe_names_the_agent_that_ended_after_it():
    """A cell that kills its own agent breaks rank 1's connection before the agent's exit can be
    seen: the cell must name the agent's exit, not the broken pipe (a flake seen in CI)."""
    from fsdp2nb.frontend.errors import RankError
    from fsdp2nb.frontend.request_wait import RequestWait

    pool = WorkerPool(PoolSpec(devices=("cpu", "cpu")))
    pool._launched, pool.state = _EndsLater(AgentExit("ended by a SIGTERM it was sent", pid=41), after=5), "ready"
    sent: list = []

    def send(ranks, message, connect_timeout_s: float = 5.0) -> None:
        sent.append(message)
        raise ConnectionError("rank 1 is not connected to the pool ([Errno 32] Broken pipe)")

    pool.send = send
    wait = RequestWait(pool, 1, (0, 1), recover=lambda spec, what: f"restarted after: {what}",
                       ask_input=lambda prompt, password: "")
    with pytest.raises(RankError) as raised:
        wait.send(object())
    text = "\n".join(raised.value._render_traceback_())
    assert "ended with its host agent: the host agent (pid 41) ended by a SIGTERM it was sent" in text, text
    assert "Broken pipe" not in text and "could not be reached" not in text
    assert pool.busy_ranks == frozenset()
