"""What a rank sets up once, before it serves its first request: the environment torchrun would
give it, its CPU scheduling, the capture of its output, the process group and mesh its cells
see, and the reporters that send events on their own (the resource sampler, progress of loads
and saves, profiles).

Kept apart from the request loop (rank.py), which only uses what these return.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fsdp2nb import progress
from fsdp2nb.collectives import COLLECTIVE_TIMEOUT_ENV
from fsdp2nb.host.memory_store import MEMORY_DIR_ENV
from fsdp2nb.wire.channels import RankChannels
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
from fsdp2nb.worker import profiling
from fsdp2nb.worker.capture import FdCapture, LogSink
from fsdp2nb.worker.progress_sender import ProgressSender
from fsdp2nb.worker.rendezvous import open_store
from fsdp2nb.worker.sampler import ResourceSampler


def torchrun_environment(plan: LaunchPlan, rank_plan: RankPlan) -> dict[str, str]:
    """The variables torchrun would set for this rank, so library code that reads them works."""
    return dict(
        RANK=str(rank_plan.rank), LOCAL_RANK=str(rank_plan.local_rank), WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(len(plan.ranks_of_node(rank_plan.node))), GROUP_RANK=str(rank_plan.node),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.master_port), TORCHELASTIC_RUN_ID=plan.pool_id,
        **{COLLECTIVE_TIMEOUT_ENV: str(plan.collective_timeout_s)},
        **({MEMORY_DIR_ENV: plan.memory_dir} if plan.memory_dir else {}),
    )


def run_as_batch_work() -> None:
    """Put this process, and every thread and process it starts later, under SCHED_BATCH.

    A rank is throughput work, and the notebook kernel is the process a person waits on. A
    normal task that wakes takes the CPU from the task running there, so each rank woken by a
    cell's request (or by gloo's loop thread, which polls 100 times a second) could stop the
    kernel in the middle of sending the request to the next rank. Batch tasks never take a CPU
    on waking; among themselves they share CPUs exactly as before.
    """
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or refused: stay as started
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def capture_output(send_stream: Callable[[str, str], None], log: LogSink,
                   pipes: dict[int, tuple[int, int]]) -> dict[str, FdCapture]:
    """Capture fds 1 and 2, the user's prints and C code's alike, into the rank's log and its
    stream events; `pipes` are the agent's (see agent.py), which it drains should the rank die."""
    return {
        "stdout": FdCapture(1, lambda text: send_stream("stdout", text), log, pipes.get(1)),
        "stderr": FdCapture(2, lambda text: send_stream("stderr", text), log, pipes.get(2)),
    }


def join_process_group(plan: LaunchPlan, rank: int, device_name: str, channels: RankChannels) -> dict:
    """Join the process group (`rendezvous`: a FileStore on one host, rank 0's TCPStore across
    hosts); returns the names every cell sees (`rank`, `device`, `mesh`, ...)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks sharing a host split its cores instead of oversubscribing. torchrun gives
        # each of several ranks 1 thread: the same on 2 cores and 2 ranks, fewer where cores are spare.
        num_threads = max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"]))
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
    timeout = timedelta(seconds=plan.collective_timeout_s)
    store = open_store(plan, rank, channels, timeout)
    backend = plan.backend
    if backend == "gloo":  # CPU ranks: groups that a failed collective does not cost (see there)
        from fsdp2nb.worker.reformable_groups import BACKEND_NAME, register_backend

        register_backend()
        backend = BACKEND_NAME
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=plan.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    mesh = init_device_mesh(device.type, (plan.world_size,), mesh_dim_names=("dp_shard",))
    return dict(
        rank=rank, local_rank=int(os.environ["LOCAL_RANK"]), world_size=plan.world_size,
        device=device, mesh=mesh, torch=torch, dist=dist,
    )


def start_reporters(rank: int, device: str, send_event: Callable[[Any], Any],
                    current_cell_id: Callable[[], int | None],
                    trace_dir: str) -> tuple[ResourceSampler, profiling.ProfileSink]:
    """Start the resource sampler and install where progress and profiles go; returns the sampler
    and the profile sink a profiled request records into (nothing is hooked until one records)."""
    sampler = ResourceSampler(rank, device, send_event, is_busy=lambda: current_cell_id() is not None)
    sampler.start()
    progress.install(ProgressSender(rank, send_event, current_cell_id))
    profile_sink = profiling.ProfileSink(rank, device, send_event, current_cell_id, trace_dir=trace_dir)
    profiling.install(profile_sink)
    return sampler, profile_sink
