"""What pool a user asked for: how many ranks, on which devices, with which backend.

Parsing lives here (not in the magics) so that every way of starting a pool validates the same
way. Counting GPUs must not initialise CUDA in the notebook kernel, so it reads the driver's
/proc entries and CUDA_VISIBLE_DEVICES instead of asking torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from fsdp2nb.errors import InvalidValue

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
MAX_COLLECTIVE_TIMEOUT_S = 365 * 24 * 3600.0
DEFAULT_NUM_CPU_RANKS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Hosts that an engine (Ray or Slurm) provides for a pool's ranks, one host agent on each."""

    engine: Literal["ray", "slurm"]
    num_nodes: int
    """How many hosts; each runs the same devices."""
    address: str | None = None
    """Ray only: the cluster to join, "auto" or HOST:PORT."""
    listen: str | None = None
    """The kernel's address on the cluster network; found from the route to the cluster when None."""

    def __post_init__(self) -> None:
        if self.engine not in ("ray", "slurm"):
            raise InvalidValue(f"engine={self.engine!r} must be 'ray' or 'slurm'")
        if self.num_nodes < 1:
            raise InvalidValue(f"--nodes {self.num_nodes} must be at least 1")

    def describe(self) -> str:
        text = f"--ray {self.address or 'auto'}" if self.engine == "ray" else "--slurm"
        text += f" --nodes {self.num_nodes}"
        return text + (f" --listen {self.listen}" if self.listen else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSpec:
    """A pool's shape; two cells share a pool only when their specs are equal."""

    devices: tuple[str, ...]
    """One torch device string per rank of a host, e.g. ("cpu", "cpu") or ("cuda:0", "cuda:2")."""
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    """How long a collective may wait before the process group raises."""
    placement: Placement | None = None
    """Other hosts for the ranks (Ray or Slurm); None: this host only."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise InvalidValue("devices is empty: a pool needs at least one rank")
        kinds = {device.split(":")[0] for device in self.devices}
        if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
            raise InvalidValue(f"devices={self.devices!r} must be all 'cpu' or all 'cuda:N'")
        if not 0 < self.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S:
            raise InvalidValue(f"collective_timeout_s={self.collective_timeout_s!r} must be more than 0 and at most a year")

    @property
    def num_nodes(self) -> int:
        return self.placement.num_nodes if self.placement else 1

    @property
    def world_size(self) -> int:
        return len(self.devices) * self.num_nodes

    @property
    def uses_gpus(self) -> bool:
        return self.devices[0].startswith("cuda")

    @property
    def backend(self) -> str:
        # NCCL for GPU tensors plus gloo for CPU tensors (offloaded parameters, flags, RNG state).
        return "cuda:nccl,cpu:gloo" if self.uses_gpus else "gloo"

    def describe(self) -> str:
        """The options that ask for this pool, e.g. `--gpus 0,1` or `--cpu 2 --timeout 60`."""
        if self.placement is not None:
            kind = "gpus" if self.uses_gpus else "cpu"
            text = f"{self.placement.describe()} --{kind}-per-node {len(self.devices)}"
        elif self.uses_gpus:
            text = f"--gpus {','.join(d.split(':')[1] for d in self.devices)}"
        else:
            text = f"--cpu {self.world_size}"
        if self.collective_timeout_s != DEFAULT_COLLECTIVE_TIMEOUT_S:
            text += f" --timeout {self.collective_timeout_s:g}"
        return text


def visible_gpu_indices() -> list[int]:
    """CUDA device indices a rank could use, found without initialising CUDA."""
    try:
        num_physical = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        num_physical = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(num_physical))
    entries = [entry for entry in visible.split(",") if entry.strip() and entry.strip() != "-1"]
    return list(range(min(len(entries), num_physical)))


def spec_from_options(
    *, gpus: str | None, cpu: int | None, collective_timeout_s: float | None = None,
    hosts: HostOptions | None = None,
) -> PoolSpec:
    """Turn `--gpus`/`--cpu` (or the options of `hosts`) into a spec; raises ValueError with a
    one-line explanation."""
    timeout = DEFAULT_COLLECTIVE_TIMEOUT_S if collective_timeout_s is None else collective_timeout_s
    if not 0 < timeout <= MAX_COLLECTIVE_TIMEOUT_S:  # also nan and inf, which the ranks cannot use
        raise InvalidValue(f"--timeout {timeout:g} is not usable; give the collective timeout in seconds, "
                           f"more than 0 and at most {MAX_COLLECTIVE_TIMEOUT_S:.0f} (a year)")
    if hosts is not None and hosts.given:
        return multi_host_spec(hosts, gpus=gpus, cpu=cpu, collective_timeout_s=timeout)
    if gpus is not None and cpu is not None:
        raise InvalidValue("--gpus and --cpu exclude each other: pick GPUs or CPU ranks")
    if gpus is not None:
        return PoolSpec(devices=tuple(f"cuda:{i}" for i in _parse_gpus(gpus)), collective_timeout_s=timeout)
    num_ranks = DEFAULT_NUM_CPU_RANKS if cpu is None else cpu
    if num_ranks < 1:
        raise InvalidValue(f"--cpu {num_ranks} must be at least 1 (the number of CPU ranks)")
    return PoolSpec(devices=("cpu",) * num_ranks, collective_timeout_s=timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostOptions:
    """The options that place a pool on other hosts, as the magics parsed them."""

    ray: str | None = None
    """"auto" or HOST:PORT when `--ray` was given."""
    slurm: bool = False
    num_nodes: int | None = None
    gpus_per_node: int | None = None
    cpu_per_node: int | None = None
    listen: str | None = None

    @property
    def given(self) -> bool:
        return (self.ray is not None or self.slurm or self.num_nodes is not None or self.gpus_per_node is not None
                or self.cpu_per_node is not None or self.listen is not None)


def multi_host_spec(hosts: HostOptions, *, gpus: str | None, cpu: int | None, collective_timeout_s: float,
                    environ: Mapping[str, str] | None = None) -> PoolSpec:
    """A spec for ranks on other hosts; raises ValueError with a one-line explanation."""
    env = os.environ if environ is None else environ
    if hosts.ray is None and not hosts.slurm:
        raise InvalidValue("--nodes, --gpus-per-node, --cpu-per-node and --listen place ranks on other hosts: "
                           "add --ray [auto|HOST:PORT] or --slurm")
    if hosts.ray is not None and hosts.slurm:
        raise InvalidValue("--ray and --slurm exclude each other: pick the engine that provides the hosts")
    if gpus is not None or cpu is not None:
        raise InvalidValue("--gpus and --cpu place ranks on this host; across hosts use --gpus-per-node N "
                           "or --cpu-per-node N")
    given = [n for n in (hosts.gpus_per_node, hosts.cpu_per_node) if n is not None]
    if len(given) != 1:
        raise InvalidValue("say what each host runs: --gpus-per-node N or --cpu-per-node N (one of them)")
    per_node = given[0]
    if per_node < 1:
        raise InvalidValue(f"{per_node} ranks per host: give at least 1")
    if hosts.slurm and not env.get("SLURM_JOB_ID"):
        raise InvalidValue("--slurm runs inside a Slurm allocation (salloc or sbatch), and SLURM_JOB_ID is not set")
    num_nodes = hosts.num_nodes
    if num_nodes is None and hosts.slurm:
        num_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 0) or None
    if num_nodes is None:
        raise InvalidValue("--nodes N is needed: how many hosts the pool spans")
    if hosts.listen is not None:
        from fsdp2nb.wire.endpoints import check_listen_host

        check_listen_host(hosts.listen)
    devices = tuple(f"cuda:{i}" for i in range(per_node)) if hosts.gpus_per_node else ("cpu",) * per_node
    placement = Placement(engine="ray" if hosts.ray is not None else "slurm", num_nodes=num_nodes,
                          address=hosts.ray, listen=hosts.listen)
    return PoolSpec(devices=devices, collective_timeout_s=collective_timeout_s, placement=placement)


def default_spec() -> PoolSpec:
    """All visible GPUs, else two CPU ranks."""
    gpus = visible_gpu_indices()
    if gpus:
        return PoolSpec(devices=tuple(f"cuda:{i}" for i in gpus))
    return PoolSpec(devices=("cpu",) * DEFAULT_NUM_CPU_RANKS)


def _parse_gpus(text: str) -> list[int]:
    """`4` means the first four visible GPUs; `0,2,3` (or `1,`) names GPUs by index."""
    visible = visible_gpu_indices()
    if not visible:
        raise InvalidValue(f"--gpus {text}: no CUDA GPU is visible here; use --cpu N for CPU ranks")
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidValue(f"--gpus {text!r} is neither a count (4) nor a list of indices (0,2,3)") from None
    if not numbers:
        raise InvalidValue("--gpus needs a count (4) or a list of indices (0,2,3)")
    if "," not in text:
        count = numbers[0]
        if count < 1:
            raise InvalidValue(f"--gpus {count} must be at least 1 (a count of GPUs)")
        if count > len(visible):
            raise InvalidValue(f"--gpus {count} asks for more GPUs than the {len(visible)} visible")
        return visible[:count]
    bad = [i for i in numbers if i not in visible]
    if bad:
        raise InvalidValue(f"--gpus {text}: GPU index {bad[0]} is not among the visible GPUs {visible}")
    if len(set(numbers)) != len(numbers):
        raise InvalidValue(f"--gpus {text} names a GPU twice")
    return numbers


def parse_rank_list(text: str, world_size: int) -> tuple[int, ...]:
    """`0`, `0,2` or `1-3` -> sorted ranks, each checked against the world size."""
    ranks: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            ranks.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise InvalidValue(f"--ranks {text!r} is not a rank list such as 0 or 0,2 or 1-3") from None
    if not ranks:
        raise InvalidValue("--ranks needs at least one rank, such as 0 or 0,2")
    outside = sorted(r for r in ranks if not 0 <= r < world_size)
    if outside:
        raise InvalidValue(f"--ranks {text}: rank {outside[0]} does not exist; the pool has ranks 0-{world_size - 1}")
    return tuple(sorted(ranks))
