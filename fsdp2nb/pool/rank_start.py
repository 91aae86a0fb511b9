"""How a pool's ranks come up: the launcher its spec asks for, the certificate ranks check when
they connect over TCP, and the wait until every rank has joined, with the line that says why a
start failed.

WorkerPool (pool/pool.py) runs these steps when it starts or attaches a pool. They keep no state:
the pool owns its events, channels and launch, and passes them in; what a running pool does
stays there.
"""

from __future__ import annotations

import time

from fsdp2nb.errors import PoolStartError
from fsdp2nb.pool.launcher import LaunchedRanks, Launcher, LocalLauncher, describe_agent_exit, describe_exit
from fsdp2nb.pool.rank_events import RankEvents
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.channels import KernelChannels
from fsdp2nb.wire.endpoints import is_tcp
from fsdp2nb.wire.requests import JoinRendezvous
from fsdp2nb.wire.tls import PoolCertificate

DEFAULT_START_TIMEOUT_S = 300.0


def launcher_for(spec: PoolSpec) -> Launcher:
    """The launcher a spec asks for: this host, or the hosts Ray or Slurm provides."""
    if spec.placement is None:
        return LocalLauncher()
    if spec.placement.engine == "ray":
        from fsdp2nb.pool.ray_launcher import RayLauncher

        return RayLauncher(spec)
    from fsdp2nb.pool.slurm_launcher import SlurmLauncher

    return SlurmLauncher(spec)


def pool_certificate(address: str, runtime_dir: str) -> PoolCertificate | None:
    """A fresh certificate for a pool whose ranks connect over TCP; None for a Unix socket."""
    if not is_tcp(address):
        return None
    from fsdp2nb.wire.tls import make_pool_certificate

    return make_pool_certificate(runtime_dir)


def wait_until_joined(spec: PoolSpec, events: RankEvents, channels: KernelChannels, launched: LaunchedRanks, *,
                      timeout_s: float, log_dir: str, lost_agents: dict[int, str]) -> None:
    """Return once every rank has joined and its requests and control connections are admitted;
    else PoolStartError with one line saying why. `lost_agents`: node -> host of agents whose
    connection ended, filled meanwhile by the thread that reads the events."""
    deadline = time.monotonic() + timeout_s
    while not (events.all_joined.wait(0.05) and channels.has_links(tuple(events.ranks))):
        _pass_rendezvous_on(spec, events, channels)
        if channels.refused_version is not None:  # ranks of another fsdp2nb: they will not join
            raise PoolStartError(channels.refused_version)
        if events.exited or not launched.is_running():
            raise PoolStartError(_start_failure(spec, events, launched, log_dir, lost_agents))
        if time.monotonic() > deadline:
            raise PoolStartError(f"the ranks did not start within {timeout_s:.0f} s (logs: {log_dir})")


def _pass_rendezvous_on(spec: PoolSpec, events: RankEvents, channels: KernelChannels) -> None:
    """Tell ranks 1.. where rank 0's store listens, once it says so (multi-host pools)."""
    opened = events.take_rendezvous()
    if opened is not None:
        channels.send(tuple(range(1, spec.world_size)), JoinRendezvous(host=opened.host, port=opened.port),
                      connect_timeout_s=DEFAULT_START_TIMEOUT_S)


def _start_failure(spec: PoolSpec, events: RankEvents, launched: LaunchedRanks, log_dir: str,
                   lost_agents: dict[int, str]) -> str:
    for exit_report in events.exited.values():
        tail = "\n".join(exit_report.stderr_tail[-10:])
        return f"rank {exit_report.rank} exited while starting ({describe_exit(exit_report)}):\n{tail}"
    if spec.placement is not None:
        ended = launched.agent_exit()
        which = (describe_agent_exit(ended, lost_agents, len(spec.devices)) if ended is not None
                 else "the host agent ended")
        return f"{which} while starting the ranks; see the agent logs in {log_dir}"
    return f"the host agent exited while starting the ranks; see {log_dir}/agent.log"
