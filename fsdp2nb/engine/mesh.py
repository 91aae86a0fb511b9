"""The device meshes the engine shards over: the flat one (every rank shards) and HSDP's 2-D one.

On a 2-D mesh `("replicate", "shard")` FSDP2 shards each parameter along the "shard" dimension
and keeps one copy of the model per row of the "replicate" dimension: parameters are
`(Replicate(), Shard(0))` DTensors. All-gathers and reduce-scatters stay inside a row, and only
one all-reduce of the gradient shards per step runs along "replicate". Rows of ranks on one host
(`hsdp_mesh()` across hosts) therefore keep every per-block collective off the link between hosts.

Ranks are numbered host by host, as torchrun and the pool's launchers do (rank = node x ranks per
node + local rank), so row r of `arange(world_size).reshape(replicate, -1)` is host r's ranks.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2nb.engine.device import current_device
from fsdp2nb.errors import InvalidValue, NoProcessGroup

FLAT_DIM_NAMES: tuple[tuple[str, ...] | None, ...] = (None, ("dp_shard",), ("shard",))
"""The names a 1-D mesh may have (the ranks' `mesh` is `("dp_shard",)`)."""
HSDP_DIM_NAMES: tuple[tuple[str, str], ...] = (("replicate", "shard"), ("dp_replicate", "dp_shard"))
"""The names a 2-D mesh may have: the replicate dimension first (torchtitan's spelling second)."""

_WHAT_TO_PASS = ("pass the ranks' flat `mesh`, fsdp2nb.hsdp_mesh() (replicate across hosts, shard within one), "
                 "or init_device_mesh(device_type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))")


class InvalidMesh(InvalidValue):
    """A mesh the engine cannot shard over (or a `replicate=` that makes none); one line names
    what was wrong and what to pass. Every rank raises it alike: what it checks is the same on all."""


def require_process_group(caller: str) -> None:
    """NoProcessGroup unless this process is a rank of an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise NoProcessGroup(
            f"{caller} runs on the ranks of a process group and none is initialised here: call it in a "
            "%%fsdp2 cell (outside a notebook: after torch.distributed.init_process_group(), as under torchrun)"
        )


def flat_mesh(device_type: str) -> DeviceMesh:
    """Every rank along one "dp_shard" dimension: plain FSDP."""
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def check_mesh(mesh: object, device_type: str) -> DeviceMesh:
    """`mesh` if the engine can shard over it on this process group's ranks, else InvalidMesh."""
    if not isinstance(mesh, DeviceMesh):
        raise InvalidMesh(f"mesh={_short(mesh)} is not a DeviceMesh; {_WHAT_TO_PASS}")
    world_size = dist.get_world_size()
    shape = tuple(mesh.shape)
    names = mesh.mesh_dim_names
    if mesh.ndim not in (1, 2):
        raise InvalidMesh(f"mesh has {mesh.ndim} dimensions {shape}; the engine shards over 1 (FSDP) or "
                          f"2 (HSDP: replicate, shard): {_WHAT_TO_PASS}")
    if mesh.size() != world_size:
        raise InvalidMesh(f"mesh of shape {shape} covers {mesh.size()} ranks but the process group has "
                          f"{world_size}: every rank must be in the mesh; {_WHAT_TO_PASS}")
    if mesh.device_type != device_type:
        raise InvalidMesh(f"mesh is on {mesh.device_type!r} but this rank computes on {device_type!r}; "
                          f"make it with init_device_mesh({device_type!r}, ...) or fsdp2nb.hsdp_mesh()")
    allowed = FLAT_DIM_NAMES if mesh.ndim == 1 else HSDP_DIM_NAMES
    if names not in allowed:
        raise InvalidMesh(f"mesh_dim_names={names!r} are not names the engine knows for a {mesh.ndim}-D mesh; "
                          f"choose one of {allowed}")
    return mesh


def hsdp_mesh(replicate: int | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """A 2-D mesh `("replicate", "shard")` over every rank, for HSDP: `replicate` rows of
    `world_size // replicate` consecutive ranks, each row holding one sharded copy of the model.

    Default `replicate`: the number of hosts (WORLD_SIZE / LOCAL_WORLD_SIZE, as the pool and
    torchrun set them), so each host's ranks shard among themselves. On one host there is no
    such choice: pass `replicate=` (e.g. `hsdp_mesh(replicate=2)` on 4 ranks). Collective: call
    it on every rank. `device_type` defaults to this rank's (the engine's choice).
    """
    require_process_group("hsdp_mesh")
    world_size = dist.get_world_size()
    if replicate is None:
        replicate = _num_hosts(world_size)
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise InvalidMesh(f"replicate={replicate!r} must be a positive int that divides the {world_size} ranks")
    if world_size % replicate:
        raise InvalidMesh(f"replicate={replicate} does not divide the {world_size} ranks; choose one of "
                          f"{tuple(d for d in range(1, world_size + 1) if world_size % d == 0)}")
    if device_type is None:
        device_type = current_device().type
    return init_device_mesh(device_type, (replicate, world_size // replicate), mesh_dim_names=HSDP_DIM_NAMES[0])


def _num_hosts(world_size: int) -> int:
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_host == world_size:
        raise InvalidMesh(f"all {world_size} ranks are on one host, so hsdp_mesh() cannot choose the replicate "
                          f"dimension; pass it, e.g. fsdp2nb.hsdp_mesh(replicate=2)")
    if per_host < 1 or world_size % per_host:
        raise InvalidMesh(f"LOCAL_WORLD_SIZE={per_host} does not divide WORLD_SIZE={world_size} (hosts with "
                          "different numbers of ranks); pass replicate= explicitly")
    return world_size // per_host


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"
