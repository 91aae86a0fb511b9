"""A rank's side of profiling: torch.profiler over a cell (`%%fsdp2 --profile`) or a block
(`fsdp2nb.profile()`), its ops packed and summed into one `RankProfile` event for the kernel.

Nothing is installed until a profile starts: the rank only keeps where to send one
(`install`). The profiler's own events are read as Kineto returns them (Unix-nanosecond
stamps), without building torch's FunctionEvent tree, which would cost more than the step.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fsdp2nb.errors import UsageMistake
from fsdp2nb.profile_analysis import collector_paused, summarise
from fsdp2nb.profile_records import COLLECTIVE, GPU_COLLECTIVE, GPU_COPY, GPU_KERNEL, GPU_LANE_BASE, OP, pack
from fsdp2nb.wire.events import RankProfile

WINDOW_NAME = "fsdp2nb:profiled"
"""The range around what is profiled, on the thread that runs it: its lane is the main lane."""
_HOST_COLLECTIVE_PREFIX = "gloo:"
"""How gloo names a collective on the thread that runs it, from its enqueue to its end."""


@dataclass(frozen=True, slots=True)
class ProfileSink:
    """Where a rank sends what it profiled."""

    rank: int
    device: str
    send_event: Callable[[RankProfile], object]
    current_cell_id: Callable[[], int | None]
    trace_dir: str = ""
    """Where a GPU rank saves the profiler's own trace, for Holistic Trace Analysis in the kernel."""

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


_sink: ProfileSink | None = None
_trace_numbers = itertools.count()
_recording = threading.Lock()
"""Held while a profile records: torch.profiler cannot nest, so an inner one is a no-op."""


def install(sink: ProfileSink) -> None:
    """Where this rank's profiles go (called once by the rank at start; installs no hooks)."""
    global _sink
    _sink = sink


@contextlib.contextmanager
def profile() -> Iterator[None]:
    """Profile the block on every rank that runs it; after the cell the notebook shows it as
    `%%fsdp2 --profile` does, and `%fsdp2 profile` returns it.

        for step in range(20):
            with fsdp2nb.profile() if step in (10, 11, 12) else contextlib.nullcontext():
                train_step()

    Call it on every rank (collectives are matched across ranks). Inside a profiled cell, or
    another `profile()`, it profiles nothing more.
    """
    if _sink is None:
        raise UsageMistake("fsdp2nb.profile() profiles on the ranks of a pool: use it in a %%fsdp2 cell")
    with recording(_sink, True):
        yield


@dataclass(frozen=True, slots=True)
class _StoppedAfterReply:
    """A cell's profiler, still running once the cell ended: the rank stops it after its reply."""

    sink: ProfileSink
    profiler: object
    cell_id: int | None


_after_reply: _StoppedAfterReply | None = None


@contextlib.contextmanager
def recording(sink: ProfileSink, active: bool, *, after_reply: bool = False) -> Iterator[None]:
    """Record what the block runs and send it, whether the block returns or raises.

    `after_reply`: the profiler is stopped, and its events read and sent, by
    `send_after_reply`, so that the cell's reply does not wait for them."""
    global _after_reply
    if not active or not _recording.acquire(blocking=False):
        yield
        return
    deferred = False
    try:
        # torch.autograd's profiler, which torch.profiler.profile drives: the latter's first start
        # imports torch._inductor, seconds at which the ranks would start their cells far apart.
        from torch.autograd.profiler import profile as autograd_profile
        from torch.autograd.profiler import record_function

        profiler = autograd_profile(use_cpu=True, use_device="cuda" if sink.on_gpu else None, use_kineto=True)
        profiler.__enter__()
        try:
            if sink.on_gpu:
                _note_distributed_info()
            with record_function(WINDOW_NAME):
                yield
        finally:
            if after_reply:
                _after_reply, deferred = _StoppedAfterReply(sink, profiler, sink.current_cell_id()), True
            else:
                _stop_and_send(sink, profiler, sink.current_cell_id())
    finally:
        if not deferred:
            _recording.release()


def send_after_reply() -> None:
    """Stop the profiler of the cell just replied to and send its profile; nothing without one."""
    global _after_reply
    stopped, _after_reply = _after_reply, None
    if stopped is None:
        return
    try:
        _stop_and_send(stopped.sink, stopped.profiler, stopped.cell_id)
    except OSError:
        pass  # the kernel is gone: no one is left to show the profile to
    except Exception as error:  # the cell has replied already: the kernel's view waits for this rank
        print(f"fsdp2nb: rank {stopped.sink.rank} could not send its profile: {error!r}", file=sys.__stderr__, flush=True)
        with contextlib.suppress(Exception):
            stopped.sink.send_event(_failed_profile(stopped.sink, stopped.cell_id, error))
    finally:
        _recording.release()


def _failed_profile(sink: ProfileSink, cell_id: int | None, error: Exception) -> RankProfile:
    """In place of a profile the rank could not make, so the kernel stops waiting and says why."""
    return RankProfile(rank=sink.rank, cell_id=cell_id, device=sink.device, start_ns=0, end_ns=0, names=(),
                       ops=b"", main_lane=0, failure=f"{type(error).__name__}: {error}")


def _stop_and_send(sink: ProfileSink, profiler, cell_id: int | None) -> None:
    profiler.__exit__(None, None, None)
    with collector_paused():
        results = profiler.kineto_results
        recorded = rank_profile(sink, results, _save_kineto_trace(sink, results), cell_id=cell_id)
    sink.send_event(recorded)


def _note_distributed_info() -> None:
    """The rank and world in the trace's metadata, where Holistic Trace Analysis reads them."""
    import torch.distributed as dist
    from torch.autograd import _add_metadata_json

    if dist.is_initialized():
        info = {"backend": dist.get_backend(), "rank": dist.get_rank(), "world_size": dist.get_world_size()}
        _add_metadata_json("distributedInfo", json.dumps(info))


def _save_kineto_trace(sink: ProfileSink, results) -> str:
    """A GPU rank's own trace file (its streams and kernel correlations, which HTA reads); "" on CPU."""
    if not sink.on_gpu or not sink.trace_dir:
        return ""
    path = os.path.join(sink.trace_dir, f"kineto-rank{sink.rank}-{next(_trace_numbers)}.json")
    results.save(path)
    return path


def rank_profile(sink: ProfileSink, results, kineto_trace: str = "", *, cell_id: int | None = None) -> RankProfile:
    """The profiler's events as one event for the kernel (`results`: torch's Kineto results);
    `cell_id`: the request profiled, when no longer the rank's current one.

    One pass over every op, so its loop body is kept lean: a step has thousands of ops."""
    from torch._C._autograd import DeviceType

    names: dict[str, int] = {}
    threads: dict[int, int] = {}
    streams: dict[int, int] = {}
    flat: list[int] = []
    window = (results.trace_start_ns(), results.trace_start_ns())
    main_lane, cpu, on_gpu_rank = 0, DeviceType.CPU, sink.on_gpu
    for event in results.events():
        name = event.name()
        if on_gpu_rank and event.device_type() != cpu:
            stream = event.device_resource_id()
            lane = streams.setdefault(stream, GPU_LANE_BASE + len(streams))
            kind = _gpu_kind(name)
        else:
            thread = event.start_thread_id()
            lane = threads.setdefault(thread, len(threads))
            if name == WINDOW_NAME:
                window, main_lane = (event.start_ns(), event.end_ns()), lane
                continue
            kind = COLLECTIVE if name.startswith(_HOST_COLLECTIVE_PREFIX) and event.is_user_annotation() else OP
        flat += (names.setdefault(name, len(names)), lane, kind, event.start_ns(), event.duration_ns())
    recorded = RankProfile(rank=sink.rank, cell_id=sink.current_cell_id() if cell_id is None else cell_id, device=sink.device,
                           start_ns=window[0], end_ns=window[1], names=tuple(names), ops=pack(flat),
                           main_lane=main_lane, kineto_trace=kineto_trace)
    return summarise(recorded, flat)


def _gpu_kind(name: str) -> int:
    lowered = name.lower()
    if "nccl" in lowered:
        return GPU_COLLECTIVE
    return GPU_COPY if lowered.startswith(("memcpy", "memset")) else GPU_KERNEL
