"""Lines under a cell's error that say why memory ran out: a failed allocation's report
(`MemoryShortage`) and who sent a rank's SIGKILL."""

from __future__ import annotations

from fsdp2nb.sizes import size
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.records import ErrorInfo, MemoryShortage


def shortage_lines(errors: list[tuple[int, ErrorInfo]]) -> list[str]:
    """Two lines for each rank whose cell failed to allocate, rank by rank."""
    lines: list[str] = []
    for rank, error in sorted(errors, key=lambda item: item[0]):
        if error.memory is not None:
            lines.extend(_lines(rank, error.memory))
    return lines


def _lines(rank: int, memory: MemoryShortage) -> list[str]:
    where = "the host" if memory.device == "cpu" else memory.device
    asked = f"it asked for {size(memory.requested_bytes)}" if memory.requested_bytes is not None \
        else "the allocator did not say how much it asked for"
    had = (f"{where} had {size(memory.free_bytes)} free" if memory.free_bytes is not None else f"{where}'s free memory unknown") \
        + (f" of {size(memory.capacity_bytes)}" if memory.capacity_bytes else "")
    used = "allocated" if memory.device != "cpu" else "resident (RSS)"
    if not memory.tracked:
        held = (f"rank {rank} held {size(memory.used_bytes)} {used}; it knows no model, so it is not split: "
                "load it with `fsdp2nb.load_model` or track it with `fsdp2nb.Checkpointer(dir).track(model=...)`")
    else:
        model = memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes
        held = (f"rank {rank} held {size(memory.used_bytes)} {used}: model parameters "
                f"{size(memory.param_bytes)}, gradients {size(memory.grad_bytes)}, optimizer state "
                f"{size(memory.optimizer_bytes)}, other {size(max(0, memory.used_bytes - model))}")
    return [f"rank {rank} ran out of memory: {asked}; {had}", f"  {held}"]


def sigkill_line(event: RankExited) -> str | None:
    """Who sent a rank's SIGKILL, as far as its host could tell; None for other ends."""
    if event.signal_name != "SIGKILL":
        return None
    if event.oom_killer:
        return ("the kernel's OOM killer sent it: the host (or its memory cgroup) ran out of memory; "
                "`%fsdp2 plan` says what each rank needs")
    if event.oom_killer is False:
        return "the kernel's OOM killer did not send it (its memory cgroup counted no OOM kill): another process did"
    return ("the kernel's OOM killer is the usual sender of a SIGKILL (the host out of memory); whether it "
            "sent this one cannot be read here (no memory cgroup count, no kernel log)")
