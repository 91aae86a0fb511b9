"""The device this rank drives: its GPU where its process group moves CUDA tensors, else the CPU.

The engine puts shards there, `hsdp_mesh()` builds its mesh there, and the examples pick their
precision from it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def current_device() -> torch.device:
    """The GPU this rank drives where its process group moves CUDA tensors with NCCL (or another
    GPU backend), else the CPU: a gloo-only group (`%%fsdp2 --cpu` on a GPU host) keeps CPU ranks."""
    if not torch.cuda.is_available() or not drives_gpus(dist.get_backend_config()):
        return torch.device("cpu")
    chosen = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    index = gpu_index(chosen, os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
    if chosen is None:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def drives_gpus(backend_config: str) -> bool:
    """Whether a process group's backend config (e.g. "cuda:nccl,cpu:gloo") has a GPU backend;
    gloo lists CUDA too ("cpu:gloo,cuda:gloo") but is no reason to put shards there."""
    return any(part.startswith("cuda:") and part != "cuda:gloo" for part in backend_config.split(","))


def gpu_index(chosen: int | None, local_rank: str | None, device_count: int) -> int:
    """The GPU a rank uses: the current one once CUDA is in use (set_device, the pool's ranks),
    else its LOCAL_RANK's, as torchrun means it: CUDA's default, GPU 0, would put every rank of
    a node on one GPU."""
    if chosen is not None:
        return chosen
    return int(local_rank or 0) % device_count
