"""How a rank finds the others: a FileStore on one host, rank 0's TCPStore across hosts.

On one host the store is a file in the pool's private directory: nothing listens on a network.
Across hosts a file cannot be shared, so rank 0 opens a TCPStore on its host's cluster address
(the address it reaches the kernel from) with a port the system picks; the port travels to the
other ranks through the kernel, in signed messages (`RendezvousOpened`, `JoinRendezvous`). Rank 0
binds the listening socket itself and hands it to the store, which would otherwise listen on
every interface. Keys live under the pool's own prefix. gloo and NCCL use the interface that
carries the cluster address, never loopback.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import psutil

from fsdp2nb.wire.channels import RankChannels
from fsdp2nb.wire.events import RendezvousOpened
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
from fsdp2nb.wire.requests import JoinRendezvous


def interface_of(host: str) -> str:
    """The name of the network interface that carries `host` on this machine."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address.split("%")[0] == host for address in addresses):
            return name
    raise RuntimeError(f"no network interface of this host has the address {host}")  # internal: the launch plan named an address of this host that it lacks


def network_environment(plan: LaunchPlan, rank_plan: RankPlan, cluster_host: str | None) -> dict[str, str]:
    """Variables that steer gloo and NCCL onto the cluster interface (loopback on one host)."""
    if cluster_host is None:
        return dict(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    interface = interface_of(cluster_host)
    return dict(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface, GROUP_RANK=str(rank_plan.node))


def open_store(plan: LaunchPlan, rank: int, channels: RankChannels, timeout: timedelta):
    """The store this rank joins the process group through."""
    import torch.distributed as dist

    if not plan.multi_host:
        return dist.FileStore(os.path.join(plan.runtime_dir, "rendezvous"), plan.world_size)
    if rank == 0:
        store = _open_on_cluster_address(channels.local_host(), plan.world_size, timeout)
        channels.send_event(RendezvousOpened(host=os.environ["MASTER_ADDR"], port=store.port))
    else:
        where = _wait_for_rendezvous(channels)
        os.environ.update(MASTER_ADDR=where.host, MASTER_PORT=str(where.port))
        store = dist.TCPStore(where.host, where.port, plan.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fsdp2nb/{plan.pool_id}", store)


def _open_on_cluster_address(host: str, world_size: int, timeout: timedelta):
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    # The store takes the descriptor over: detached, Python never closes it under the store.
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def _wait_for_rendezvous(channels: RankChannels) -> JoinRendezvous:
    """Rank 0's store address, the first request a multi-host rank receives."""
    while True:
        message = channels.receive_request(-1)
        if isinstance(message, JoinRendezvous):
            return message
