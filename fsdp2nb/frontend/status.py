"""`%fsdp2 status`: one line per rank, from the latest snapshot each rank sent."""

from __future__ import annotations

from fsdp2nb.host.memory_store import kept_snapshots
from fsdp2nb.pool.handle import PoolHandle
from fsdp2nb.sizes import mib


def status_table(pool: PoolHandle | None) -> str:
    if pool is None:
        return "no pool is running"
    agent_alive = pool.check_agent()  # a dead agent took its ranks with it: say so, not "idle"
    state = f"broken: {pool.broken_reason}" if pool.state == "broken" and pool.broken_reason else pool.state
    header = f"pool {pool.spec.describe()} ({state}), logs in {pool.log_dir}"
    rows = [("rank", "pid", "device", "state", "rss", "device memory")]
    for rank in range(pool.world_size):
        info, snapshot = pool.ranks.get(rank), pool.snapshots.get(rank)
        if rank in pool.exited or not agent_alive:
            state = "exited"
        else:
            state = "busy" if rank in pool.busy_ranks else "idle"
        rss = mib(snapshot.rss_bytes) if snapshot else "-"
        device_memory = "-"
        if snapshot and snapshot.device_total_bytes:
            device_memory = f"{mib(snapshot.device_allocated_bytes)} / {mib(snapshot.device_total_bytes)}"
        rows.append((str(rank), str(info.pid if info else "-"), info.where() if info else "-", state, rss,
                     device_memory))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    snapshots = [f"in memory: {snapshot.describe()}, held by {snapshot.num_ranks_here} of "
                 f"{snapshot.world_size} ranks" for snapshot in kept_snapshots(pool.memory_dir)]
    return "\n".join([header, *lines, *snapshots])
