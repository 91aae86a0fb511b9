"""Holistic Trace Analysis (the `profile` extra) on a profile's GPU ranks: its temporal
breakdown (compute, communication, memory copies, idle per rank) and how much communication
overlapped compute. It reads the profiler's own trace files, which GPU ranks save beside their
logs (`RankProfile.kineto_trace`); the ranks must share a file system with the kernel."""

from __future__ import annotations

import os
import tempfile

from fsdp2nb.errors import UsageMistake
from fsdp2nb.wire.events import RankProfile

INSTALL_HINT = "from the clone of fsdp2nb: pip install -e '.[profile]'"


def hta_breakdown(profiles: tuple[RankProfile, ...]) -> dict:
    """{"temporal": DataFrame, "overlap": DataFrame} for the GPU ranks of one profile."""
    traces = [profile.kineto_trace for profile in profiles if profile.kineto_trace]
    if not traces:
        raise UsageMistake("Holistic Trace Analysis reads GPU ranks' traces: this profile's ranks are CPU ranks "
                           "(prof.ranks has their breakdown)")
    missing = [path for path in traces if not os.path.exists(path)]
    if missing:
        raise UsageMistake(f"the rank's trace {missing[0]} is not on this host: Holistic Trace Analysis needs the "
                           "ranks' log directory shared with the kernel")
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        raise UsageMistake(f"Holistic Trace Analysis is not installed: {INSTALL_HINT}") from None
    analysis = TraceAnalysis(trace_dir=_one_directory(traces))
    return {"temporal": analysis.get_temporal_breakdown(visualize=False),
            "overlap": analysis.get_comm_comp_overlap(visualize=False)}


def _one_directory(traces: list[str]) -> str:
    """A fresh directory holding (links to) these traces alone: HTA reads every trace in its directory."""
    directory = tempfile.mkdtemp(prefix="fsdp2nb-hta-")
    for path in traces:
        os.symlink(path, os.path.join(directory, os.path.basename(path)))
    return directory
