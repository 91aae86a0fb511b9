"""The launch plan: where each rank of a pool runs and how it reaches the kernel.

The kernel hands it once to each host agent, on the agent's stdin, as JSON: an agent may run
before it can verify a signature, so nothing there is unpickled. Its fields are part of the
wire's schema (wire/protocol.py): both ends of a pool read the same plan. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RankPlan:
    """Where one rank runs: its global and local rank, its torch device string and its host."""

    rank: int
    local_rank: int
    device: str
    node: int = 0
    """The index of the host (the agent) that starts it; 0 on a one-host pool."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a host agent needs to start its ranks and connect them to the kernel."""

    pool_id: str
    world_size: int
    backend: str
    ranks: tuple[RankPlan, ...]
    """Every rank of the pool; each host's agent starts those of its `node`."""
    address: str
    """Where every rank and agent connection starts: the kernel's Unix socket, or
    `tcp://HOST:PORT` when ranks run on other hosts."""
    runtime_dir: str
    log_dir: str
    collective_timeout_s: float
    kernel_pid: int
    """Watched by a one-host agent; an agent on another host watches its connection instead."""
    master_port: int
    num_nodes: int = 1
    tls_fingerprint: str = ""
    """SHA-256 of the kernel's TLS certificate (hex), which ranks check; TCP addresses only."""
    kept_dir: str = ""
    """A kept pool's directory (its key, attach record and activity board); empty: the pool
    ends with its kernel."""
    keep_for_s: float | None = None
    """A kept pool that no kernel holds and that runs nothing ends after this long; None: never."""
    memory_dir: str = ""
    """The snapshot store of the pool's Checkpointers (host/memory_store.py), kept across its
    restarts; removed by the agent when its kernel is gone (a kept pool's: when the pool expires)."""

    @property
    def multi_host(self) -> bool:
        return self.address.startswith("tcp://")

    def ranks_of_node(self, node: int) -> tuple[RankPlan, ...]:
        return tuple(rank for rank in self.ranks if rank.node == node)

    def encode(self, key: bytes) -> bytes:
        """The launch request an agent reads on its stdin: this plan and the pool key, as JSON
        (an agent may run before it can verify anything, so no pickle), on one line: the agent
        reads to its end, not to the pipe's, which a process the kernel forked may hold open."""
        return json.dumps({"plan": asdict(self), "key": key.hex()}).encode() + b"\n"

    @classmethod
    def decode(cls, request: bytes) -> tuple[LaunchPlan, bytes]:
        """The plan and pool key of a launch request made by `encode`."""
        fields = json.loads(request)
        plan = dict(fields["plan"])
        plan["ranks"] = tuple(RankPlan(**entry) for entry in plan["ranks"])
        return cls(**plan), bytes.fromhex(fields["key"])
