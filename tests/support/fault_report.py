"""What the fault campaign reports: one record per fault, the campaign's result, and the table
that tests/faults prints (the same for the short campaign and `make soak`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

FAULT_KINDS = ("kill_rank", "kill_agent", "kill_kernel", "stop_rank", "stop_rank_forever",
               "raise_in_collective", "interrupt_twice", "enospc",
               "truncated_shard", "deleted_metadata", "latest_missing_step")
"""Every kind the scheduler draws from."""
ENDS_A_PROCESS = ("kill_rank", "kill_agent", "kill_kernel", "stop_rank_forever")
"""Kinds after which a process is gone or never runs again: only these may cost the ranks'
state (a restart). Every other fault must leave every rank's variables, model and optimizer."""


@dataclass
class FaultRecord:
    """What one injected fault did and what recovering from it took."""

    number: int
    kind: str
    moment: str
    detail: str = ""
    skipped: str = ""
    """Why the fault could not be injected here (empty when it was)."""
    struck: bool = False
    """The fault hit while its moment's work was still running."""
    cell_outcome: str = ""
    recovered: bool = False
    """Training went on through the automatic restart, a setup cell and `%fsdp2 load latest`."""
    recovery_path: str = ""
    recover_s: float = 0.0
    steps_redone: int = 0
    latest_before: int | None = None
    restored_step: int | None = None
    checkpoint_lost: bool = False
    latest_ok: bool = True
    """After the fault, LATEST named a complete checkpoint (damage kinds excepted)."""
    problems: list[str] = field(default_factory=list)
    """What went wrong: each one fails the campaign."""
    notes: list[str] = field(default_factory=list)
    """What happened on the way that a user also meets (a setup cell run twice)."""
    restart_told: bool = False
    """A cell said the pool is broken and to `%fsdp2 restart`, and the campaign did."""
    retried_after_restart: bool = False
    state_kept: bool = False
    """The same rank processes ran before and after the struck cell: nothing was restarted."""
    kept_in_memory: int | None = None
    """The step the restart's note said was kept in host memory (None: it said none was)."""
    from_memory: bool = False
    """The recovery restored the snapshot in host memory, not a checkpoint from disk."""


@dataclass
class CampaignResult:
    seed: int
    num_ranks: int
    records: list[FaultRecord]
    final_step: int
    digests: tuple[str, ...]
    reference_digests: tuple[str, ...]
    orphans: list[str]
    foreign_shm: list[str]
    wall_s: float

    @property
    def injected(self) -> list[FaultRecord]:
        return [r for r in self.records if not r.skipped]

    @property
    def state_matches(self) -> bool:
        return bool(self.digests) and self.digests == self.reference_digests

    def failures(self) -> list[FaultRecord]:
        return [r for r in self.injected if not r.recovered or r.checkpoint_lost or not r.latest_ok or r.problems]


def record_line(record: FaultRecord) -> str:
    if record.skipped:
        return f"#{record.number:<3} {record.kind:<20} skipped: {record.skipped}"
    state = "recovered" if record.recovered else f"NOT recovered ({record.recovery_path})"
    problems = f" PROBLEMS: {'; '.join(record.problems)}" if record.problems else ""
    problems += f" notes: {'; '.join(record.notes)}" if record.notes else ""
    source = "memory" if record.from_memory else "disk"
    return (f"#{record.number:<3} {record.kind:<20} {record.moment:<11} {state}, restored step "
            f"{record.restored_step} ({source}) in {record.recover_s:.1f} s, {record.steps_redone} redone "
            f"[{record.detail}] cell: {record.cell_outcome}{problems}")


def summary_table(result: CampaignResult) -> str:
    """One table: faults by kind, recovered, time to recover, steps redone, losses, orphans."""
    rows = [("kind", "injected", "struck mid-work", "state kept", "restarted", "restored from memory",
             "recovered", "recover median s", "recover max s", "steps redone", "ckpt lost", "LATEST bad", "failed")]
    by_kind: dict[str, list[FaultRecord]] = {}
    for record in result.records:
        by_kind.setdefault(record.kind, []).append(record)
    for kind in [*FAULT_KINDS, "all"]:
        records = [r for r in result.injected if kind in ("all", r.kind)]
        skipped = [r for r in by_kind.get(kind, []) if r.skipped]
        if not records and not skipped:
            continue
        times = [r.recover_s for r in records if r.recovered]
        rows.append((kind, str(len(records)) + (f" ({len(skipped)} skipped)" if skipped else ""),
                     str(sum(r.struck for r in records)),
                     str(sum(r.state_kept for r in records)), str(sum(not r.state_kept for r in records)),
                     str(sum(r.from_memory for r in records)), str(sum(r.recovered for r in records)),
                     f"{statistics.median(times):.1f}" if times else "-", f"{max(times):.1f}" if times else "-",
                     str(sum(r.steps_redone for r in records)), str(sum(r.checkpoint_lost for r in records)),
                     str(sum(not r.latest_ok for r in records)),
                     str(sum(r in result.failures() for r in records))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    lines.append("")
    lines.append(f"seed {result.seed}, {result.num_ranks} ranks, final step {result.final_step}, "
                 f"{result.wall_s:.0f} s; model and optimizer equal the fault-free run bitwise: "
                 f"{result.state_matches} ({' '.join(result.digests)} vs {' '.join(result.reference_digests)}); "
                 f"orphans: {len(result.orphans)}")
    lines.extend(f"  orphan: {orphan}" for orphan in result.orphans)
    if result.foreign_shm:
        lines.append(f"  /dev/shm entries of other processes, not counted: {len(result.foreign_shm)}")
    return "\n".join(lines)
