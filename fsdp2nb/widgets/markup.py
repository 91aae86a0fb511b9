"""The dashboard's pieces as HTML (with inline SVG plots) and as plain text.

Inline SVG in an HTML widget needs no plotting library in the kernel or a frontend extension,
renders alike in JupyterLab, Notebook 7 and VS Code, and one plot is a string of a few
kilobytes: an unchanged plot is an unchanged string, so nothing is sent for it.
"""

from __future__ import annotations

import html
import math
import os
import time
from collections.abc import Sequence

from fsdp2nb.sizes import size
from fsdp2nb.widgets.model import MemoryReading, RankRow, TimeSplit
from fsdp2nb.wire.records import CheckpointEntry, CheckpointStatus, ProgressUpdate

_OK, _WARN, _PEAK, _RESERVED = "#3b82f6", "#dc2626", "#111827", "#bfdbfe"
_STATE_COLOURS = {"idle": "#15803d", "busy": "#b45309", "dead": "#dc2626", "starting": "#6b7280",
                  "stopped": "#6b7280"}
SPARK_POINTS = 120


# --- memory -------------------------------------------------------------------------------------


def memory_text(memory: MemoryReading | None) -> str:
    """`1.2 GiB / 80 GiB (peak 3 GiB, reserved 2 GiB)`, or RSS for a CPU rank."""
    if memory is None:
        return "no reading yet"
    total = f" / {size(memory.total)}" if memory.total else ""
    if memory.kind == "gpu":
        return (f"{size(memory.used)}{total} alloc · reserved {size(memory.reserved)} · "
                f"peak {size(memory.peak)} · host RSS {size(memory.rss)}")
    return f"RSS {size(memory.used)}{total} · peak {size(memory.peak)}"


PART_COLOURS = {"params": "#2563eb", "grads": "#f59e0b", "optimizer": "#7c3aed", "other": "#94a3b8"}
"""One colour per part of a rank's memory, in its bar and its legend."""
_PART_NAMES = {"params": "the tracked model's parameters", "grads": "its gradients",
               "optimizer": "its optimizer state", "other": "everything else"}


def tracked_text(memory: MemoryReading | None) -> str:
    """`params 1 MiB · grads 1 MiB · optimizer 2 MiB · other 1.2 GiB`; empty before a model is tracked."""
    if memory is None or not any(memory.tracked):
        return ""
    return " · ".join(f"{part} {size(value)}" for part, value in memory.parts)


def tracked_html(memory: MemoryReading | None) -> str:
    """`tracked_text` with each part's colour as a square before it, the bar's legend."""
    if memory is None or not any(memory.tracked):
        return ""
    return " · ".join(f'<span style="white-space:nowrap"><span style="color:{PART_COLOURS[part]}">■</span> '
                      f'{part} {html.escape(size(value))}</span>' for part, value in memory.parts)


def memory_bar(memory: MemoryReading | None, width: int = 146, height: int = 12) -> str:
    """A bar of `used` against the total, split by part (`MemoryReading.parts`) once a model is
    tracked, over `reserved`; red past 90%; a tick at the peak. Under it a strip as wide as the bar
    shows the parts as shares of `used`: a small model on a large host is a sliver above and
    still readable below. Each part says its name and size on hover."""
    if memory is None or not memory.total:
        return f'<svg width="{width}" height="{height}"><rect width="{width}" height="{height}" fill="#e5e7eb"/></svg>'
    x = lambda value: min(width, round(width * value / memory.total))  # noqa: E731
    split = any(memory.tracked)
    strip = 4 if split else 0
    outline = f' stroke="{_WARN}" stroke-width="2"' if memory.warning else ""
    parts = [f'<rect width="{width}" height="{height}" fill="#e5e7eb" rx="2"{outline}/>',
             f'<rect width="{x(memory.reserved)}" height="{height}" fill="{_RESERVED}" rx="2"/>']
    if split:
        parts += _stacked(memory.parts, memory.total, width, 0, height, "fsdp2nb-used", warn=memory.warning)
        parts += _stacked(memory.parts, max(memory.used, 1), width, height + 2, strip, "fsdp2nb-part")
    else:
        parts.append(f'<rect class="fsdp2nb-used" width="{x(memory.used)}" height="{height}" '
                     f'fill="{_WARN if memory.warning else _OK}" rx="2"/>')
    if memory.peak:
        parts.append(f'<rect x="{max(0, x(memory.peak) - 2)}" width="2" height="{height}" fill="{_PEAK}"/>')
    total_height = height + (strip + 2 if split else 0)
    return f'<svg width="{width}" height="{total_height}" class="fsdp2nb-bar">{"".join(parts)}</svg>'


def _stacked(parts: tuple[tuple[str, int], ...], scale: int, width: int, y: int, height: int, css: str,
             warn: bool = False) -> list[str]:
    """One rect per part, left to right, each `width * bytes / scale` wide (cumulative rounding,
    so the pieces add up to the whole)."""
    rects, done, left = [], 0, 0
    for part, value in parts:
        done += value
        right = min(width, round(width * done / scale))
        colour = _WARN if warn and part == "other" else PART_COLOURS[part]
        rects.append(f'<rect class="{css}" data-part="{part}" x="{left}" y="{y}" width="{right - left}" '
                     f'height="{height}" fill="{colour}"><title>{_PART_NAMES[part]}: {size(value)}</title></rect>')
        left = right
    return rects


def sparkline(values: tuple[float, ...], width: int = 104, height: int = 22) -> str:
    """The last minutes of memory as a line; each pixel column keeps its bucket's maximum, so a
    short spike stays visible."""
    buckets = _bucket_max(values, SPARK_POINTS)
    if len(buckets) < 2:
        return f'<svg width="{width}" height="{height}"></svg>'
    low, high = min(buckets), max(buckets)
    span = (high - low) or 1.0
    step = width / (len(buckets) - 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - (v - low) / span * (height - 4):.1f}" for i, v in enumerate(buckets))
    return (f'<svg width="{width}" height="{height}" class="fsdp2nb-spark"><polyline points="{points}" '
            f'fill="none" stroke="#6b7280" stroke-width="1.2"/></svg>')


def _bucket_max(values: tuple[float, ...], buckets: int) -> list[float]:
    if len(values) <= buckets:
        return list(values)
    per = len(values) / buckets
    return [max(values[int(i * per):max(int((i + 1) * per), int(i * per) + 1)]) for i in range(buckets)]


_ROW_STYLE = ("display:grid;grid-template-columns:120px 92px 150px 110px 1fr auto;align-items:center;"
              "column-gap:8px;line-height:1.35;padding:2px 0;font-size:12px")
STYLE = ("<style>.fsdp2nb-steps select{font-family:var(--jp-code-font-family,monospace);font-size:12px}"
         ".fsdp2nb-dashboard .widget-html-content{line-height:1.35}</style>")
"""CSS for the list and the HTML rows; sent once, in the header."""


_TRACKED_WHEN = '"as the last cell on this rank left them"'
"""The tracked sizes are read when a request ends, never by the sampler mid-cell (worker/sampler.py)."""


def rank_row_html(row: RankRow) -> str:
    colour = _STATE_COLOURS.get(row.state, "#6b7280")
    warn = ' style="color:#dc2626;font-weight:600"' if row.memory is not None and row.memory.warning else ""
    tracked = tracked_html(row.memory)
    return (f'<div class="fsdp2nb-rank" data-rank="{row.rank}" data-state="{row.state}" style="{_ROW_STYLE}">'
            f'<span><b>rank {row.rank}</b><br><span style="color:#6b7280">{html.escape(row.device)} · '
            f'pid {row.pid or "-"}</span></span>'
            f'<span style="color:{colour}">● {html.escape(row.state_text)}</span>'
            f'{memory_bar(row.memory)}{sparkline(row.history)}'
            f'<span class="fsdp2nb-mem"><span{warn}>{html.escape(memory_text(row.memory))}</span>'
            f'{"<br><span style=color:#6b7280 title=" + _TRACKED_WHEN + ">" + tracked + "</span>" if tracked else ""}'
            f'</span>{time_bar(row.time_split)}</div>')


_TIME_COLOURS = (("compute", "#4c78a8"), ("communication", "#f2a541"), ("waiting", "#d62728"), ("idle", "#d1d5db"))
"""The profile view's colours (frontend/profile_view.py), so the two read alike."""


def time_bar(split: TimeSplit | None, width: int = 104, height: int = 12) -> str:
    """The last profiled cell on this rank: compute, communication (waiting in red), idle."""
    if split is None or split.wall_s <= 0:
        return ""
    parts = (split.compute_s, split.communication_s - split.waiting_s, split.waiting_s, split.idle_s)
    x, rects = 0.0, []
    for (kind, colour), seconds in zip(_TIME_COLOURS, parts, strict=True):
        share = max(0.0, seconds) / split.wall_s * width
        rects.append(f'<rect class="fsdp2nb-time-{kind}" x="{x:.1f}" width="{share:.1f}" height="{height}" '
                     f'fill="{colour}"/>')
        x += share
    title = (f"last profile: wall {split.wall_s * 1e3:.1f} ms = compute {split.compute_s * 1e3:.1f} + communication "
             f"{split.communication_s * 1e3:.1f} (waiting {split.waiting_s * 1e3:.1f}) + idle {split.idle_s * 1e3:.1f} ms"
             + ("; the straggler" if split.straggler else ""))
    outline = ' stroke="#d62728" stroke-width="2"' if split.straggler else ""
    return (f'<span title="{html.escape(title)}"><svg class="fsdp2nb-time" width="{width}" height="{height}">'
            f'{"".join(rects)}<rect width="{width}" height="{height}" fill="none"{outline}/></svg>'
            '<br><span style="color:#6b7280">last profile</span></span>')


# --- training curves ----------------------------------------------------------------------------


_SERIES_COLOURS = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#db2777", "#0891b2", "#ca8a04", "#4b5563")


def metric_plot(series: dict[str, list[tuple[int, float]]], name: str, width: int = 520, height: int = 130) -> str:
    """Lines of `name` against step, one per series, with the axes' ranges at the corners."""
    series = {label: [(s, v) for s, v in line if math.isfinite(v)] for label, line in series.items()}
    series = {label: line for label, line in series.items() if line}
    if not series:
        return ('<div class="fsdp2nb-plot" data-points="0" style="color:#6b7280">no values logged yet: '
                'call <code>fsdp2nb.log(step, loss=loss)</code> in the training loop</div>')
    every = [point for line in series.values() for point in line]
    x0, x1 = min(s for s, _ in every), max(s for s, _ in every)
    y0, y1 = min(v for _, v in every), max(v for _, v in every)
    sx = lambda s: 40 + (s - x0) / ((x1 - x0) or 1) * (width - 50)  # noqa: E731
    sy = lambda v: 8 + (y1 - v) / ((y1 - y0) or 1) * (height - 26)  # noqa: E731
    lines, captions = [], []
    for index, (label, line) in enumerate(series.items()):
        colour = _SERIES_COLOURS[index % len(_SERIES_COLOURS)]
        points = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in _thin(line, 400))
        lines.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        captions.append(f'<span style="color:{colour}">{html.escape(label)}</span> {line[-1][1]:.5g}')
    first = next(iter(series.values()))
    return (f'<div class="fsdp2nb-plot" data-points="{len(first)}"><svg width="{width}" height="{height}">'
            f'<rect x="40" y="8" width="{width - 50}" height="{height - 26}" fill="#f9fafb" stroke="#e5e7eb"/>'
            f'{"".join(lines)}'
            f'<text x="36" y="16" font-size="10" text-anchor="end">{y1:.4g}</text>'
            f'<text x="36" y="{height - 18}" font-size="10" text-anchor="end">{y0:.4g}</text>'
            f'<text x="40" y="{height - 4}" font-size="10">step {x0}</text>'
            f'<text x="{width - 10}" y="{height - 4}" font-size="10" text-anchor="end">step {x1}</text>'
            f'</svg><br><small>{html.escape(name)} at step {first[-1][0]}: {" · ".join(captions)}</small></div>')


def _thin(line: list[tuple[int, float]], most: int) -> list[tuple[int, float]]:
    """At most about `most` points (the last one kept): a plot wider than its pixels sends bytes for nothing."""
    if len(line) <= most:
        return line
    every = -(-len(line) // most)
    return line[::every] + ([line[-1]] if (len(line) - 1) % every else [])


# --- checkpoints --------------------------------------------------------------------------------


def checkpoint_label(entry: CheckpointEntry, latest: int | None) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(entry.wall_time)) if entry.wall_time else "--:--:--"
    world = f"{entry.world_size} ranks" if entry.world_size else "? ranks"
    flags = (" · LATEST" if entry.step == latest else "") + ("" if entry.valid else " · incomplete")
    return f"step {entry.step:>7} · {when} · {size(entry.size_bytes):>9} · {world}{flags}".replace(" ", "\u00a0")


def checkpoint_options(view: CheckpointStatus | None) -> list[tuple[str, int]]:
    """(label, step) pairs, newest first, for the selection list."""
    if view is None:
        return []
    return [(checkpoint_label(e, view.latest_step), e.step) for e in reversed(view.entries)]


def checkpoint_header(view: CheckpointStatus | None, trainer_view: CheckpointStatus | None = None) -> str:
    if view is None and trainer_view is not None:  # Trainer keeps its own checkpoints: no advice needed
        return '<span style="color:#6b7280">no tracked checkpointer: <b>Save now</b> asks the Trainer</span>'
    if view is None:
        return ('<span style="color:#6b7280">no tracked checkpointer: run '
                '<code>fsdp2nb.Checkpointer(dir).track(model=..., optimizer=...)</code> on the ranks</span>')
    saving = f" · saving step {view.saving_step}" if view.saving_step is not None else ""
    latest = view.latest_step if view.latest_step is not None else "none"
    memory = (f' · <span class="fsdp2nb-memory-step">step {view.memory_step} in memory</span>'
              if view.memory_step is not None else "")
    return (f'<span class="fsdp2nb-ckpt-dir"><b>checkpoints</b> in <code>{html.escape(view.directory)}</code> · '
            f'LATEST {latest}{saving}{memory}</span>')


def trainer_checkpoint_label(entry: CheckpointEntry) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(entry.wall_time)) if entry.wall_time else "--:--:--"
    world = f"{entry.world_size} ranks" if entry.world_size else "? ranks"
    flags = "" if entry.valid else " · incomplete"
    return f"{os.path.basename(entry.path)} · {when} · {size(entry.size_bytes)} · {world}{flags}"


def trainer_checkpoints_html(view: CheckpointStatus | None) -> str:
    """The Trainer's `checkpoint-N` directories, newest first; empty when no Trainer reported any.
    Read-only: Trainer resumes from them (`resume_from_checkpoint`), not the panel's Load."""
    if view is None:
        return ""
    lines = [html.escape(trainer_checkpoint_label(e)) for e in reversed(view.entries)] or ["none yet"]
    return (f'<div class="fsdp2nb-trainer-checkpoints" style="font-size:12px"><b>Trainer checkpoints</b> in '
            f'<code>{html.escape(view.directory)}</code><br>{"<br>".join(lines)}</div>')


# --- progress of long work ----------------------------------------------------------------------


def task_text(task: ProgressUpdate) -> str:
    """`saving step 40: 1.2 GiB of 3 GiB (40%) · 12 of 30 tensors · 210 MiB/s · 9 s left`."""
    if task.error:
        return f"{task.label} failed: {task.error}"
    if task.kind in COUNTED_UNITS:
        return _counted_text(task, *COUNTED_UNITS[task.kind])
    amount = f"{size(task.done_bytes)} of {size(task.total_bytes)}" if task.total_bytes else ""
    if task.finished:
        rate = f" ({size(int(task.rate))}/s)" if task.rate else ""
        return f"{task.label}: done, {size(task.done_bytes)} in {task.elapsed_s:.1f} s{rate}"
    parts = [f"{amount} ({task.fraction:.0%})" if amount else f"{task.fraction:.0%}"]
    if task.total_items:
        parts.append(f"{task.done_items} of {task.total_items} tensors")
    if task.rate:
        parts.append(f"{size(int(task.rate))}/s")
    if task.seconds_left is not None:
        parts.append(f"{task.seconds_left:.0f} s left")
    return f"{task.label}: {' · '.join(parts)}"


COUNTED_UNITS = {"train": ("step", "steps"), "evaluate": ("batch", "batches")}
"""Tasks counted in units rather than bytes: a Trainer's steps, `fsdp2nb.evaluate`'s batches."""


def _counted_text(task: ProgressUpdate, unit: str, units: str) -> str:
    """`training: step 40 of 100 (40%) · 2.1 steps/s · 29 s left`, or the same in batches."""
    per_s = task.done_items / task.elapsed_s if task.elapsed_s > 0 else 0.0
    if task.finished:
        return f"{task.label}: done, {task.done_items} {units} in {task.elapsed_s:.1f} s"
    parts = [f"{unit} {task.done_items} of {task.total_items} ({task.fraction:.0%})"]
    if per_s:
        parts.append(f"{per_s:.2g} {units}/s")
        parts.append(f"{max(0, task.total_items - task.done_items) / per_s:.0f} s left")
    return f"{task.label}: {' · '.join(parts)}"


def task_html(task: ProgressUpdate | None, width: int = 220, height: int = 12) -> str:
    """A bar and `task_text`; empty when there is no task."""
    if task is None:
        return ""
    fill = _WARN if task.error else ("#16a34a" if task.finished else _OK)
    done = round(width * task.fraction)
    return (f'<div class="fsdp2nb-progress" data-kind="{html.escape(task.kind)}" '
            f'data-finished="{str(task.finished).lower()}" style="display:flex;align-items:center;gap:8px;'
            f'font-size:12px"><svg width="{width}" height="{height}"><rect width="{width}" height="{height}" '
            f'fill="#e5e7eb" rx="2"/><rect width="{done}" height="{height}" fill="{fill}" rx="2"/></svg>'
            f'<span>{html.escape(task_text(task))}</span></div>')


# --- text, where widgets cannot render ------------------------------------------------------------


def text_tables(rows: list[RankRow], view: CheckpointStatus | None, pool_line: str,
                trainer_view: CheckpointStatus | None = None) -> str:
    lines = [pool_line, _table([("rank", "state", "device", "pid", "memory", "tracked")] + [
        (str(r.rank), r.state_text, r.device, str(r.pid or "-"), memory_text(r.memory), tracked_text(r.memory) or "-")
        for r in rows])]
    if view is None:
        lines.append("no tracked checkpointer")
    else:
        memory = f"; step {view.memory_step} in memory" if view.memory_step is not None else ""
        lines.append(f"checkpoints in {view.directory} (LATEST {view.latest_step}{memory})")
        lines.append(_table([("step", "saved", "size", "ranks", "complete")] + [
            (str(e.step) + (" LATEST" if e.step == view.latest_step else ""),
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.wall_time)) if e.wall_time else "-",
             size(e.size_bytes), str(e.world_size or "-"), "yes" if e.valid else "no") for e in view.entries]))
    if trainer_view is not None:
        lines.append(f"Trainer checkpoints in {trainer_view.directory}")
        lines.extend(trainer_checkpoint_label(e) for e in reversed(trainer_view.entries))
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
