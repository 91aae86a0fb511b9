"""A profiled cell as the notebook shows it: the straggler, one row per rank, the top ops and a
timeline, one lane per rank on one clock (inline SVG: no frontend extension needed)."""

from __future__ import annotations

from html import escape

from fsdp2nb.profile_analysis import Interval, Lane, ProfileAnalysis, RankRow

_WIDTH = 760
_LABEL = 60
_LANE_HEIGHT = 22
_COLOURS = {"compute": "#4c78a8", "communication": "#f2a541", "waiting": "#d62728", "idle": "#e8e8e8"}
_MIN_PIXELS = 0.5
"""Intervals closer than this on screen are drawn as one: a step has thousands of ops."""


def summary_line(analysis: ProfileAnalysis) -> str:
    """One line naming the straggler (or saying no rank waited)."""
    if analysis.straggler is None:
        return "no rank waited for another in a collective"
    return (f"straggler: rank {analysis.straggler} (the other ranks waited {_seconds(analysis.waited_for_s)} "
            "for it in all)")


def render_html(analysis: ProfileAnalysis) -> str:
    clock = (f" Clocks agree within {_seconds(analysis.clock_error_s)}." if analysis.clock_error_s else "")
    return (f'<div class="fsdp2nb-profile"><p><b>{escape(summary_line(analysis))}</b>.{escape(clock)}</p>'
            f"{_rows_table(analysis.rows)}{timeline_svg(analysis.lanes)}{_top_ops_table(analysis)}</div>")


def render_text(analysis: ProfileAnalysis) -> str:
    """The rows and the straggler as plain text (a terminal, or `repr`)."""
    lines = [summary_line(analysis), f"{'rank':>4} {'wall':>9} {'compute':>9} {'comm':>9} {'waiting':>9} {'idle':>9}"]
    lines += [f"{row.rank:>4} {_seconds(row.wall_s):>9} {_seconds(row.compute_s):>9} "
              f"{_seconds(row.communication_s):>9} {_seconds(row.waiting_s):>9} {_seconds(row.idle_s):>9}"
              for row in analysis.rows]
    return "\n".join(lines)


def _rows_table(rows: tuple[RankRow, ...]) -> str:
    gpu = any(row.device.startswith("cuda") for row in rows)
    head = ["rank", "wall", "compute", "communication", "of it waiting", "idle"] + (["overlapped"] if gpu else [])
    body = []
    for row in rows:
        cells = [str(row.rank), _seconds(row.wall_s), _seconds(row.compute_s), _seconds(row.communication_s),
                 _seconds(row.waiting_s), _seconds(row.idle_s)]
        if gpu:
            share = row.overlapped_share
            cells.append("" if share is None else f"{share:.0%}")
        body.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return _table(head, body)


def _top_ops_table(analysis: ProfileAnalysis) -> str:
    body = [f'<tr><td style="text-align:left"><code>{escape(op.name)}</code></td><td>{op.calls}</td><td>{_seconds(op.self_s)}</td>'
            f"<td>{_seconds(op.total_s)}</td></tr>" for op in analysis.top_ops]
    return "<p>ops with the most time over all ranks</p>" + _table(["op", "calls", "self", "total"], body)


def _table(head: list[str], body: list[str]) -> str:
    header = "".join(f"<th>{escape(name)}</th>" for name in head)
    return f'<table class="fsdp2nb-profile-table"><tr>{header}</tr>{"".join(body)}</table>'


def timeline_svg(lanes: tuple[Lane, ...]) -> str:
    """One lane per rank: compute, communication and its waiting, collectives outlined."""
    if not lanes:
        return ""
    start = min(lane.window[0] for lane in lanes)
    end = max(lane.window[1] for lane in lanes)
    scale = (_WIDTH - _LABEL) / max(1, end - start)
    parts = []
    for index, lane in enumerate(lanes):
        y = 4 + index * _LANE_HEIGHT
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">rank {lane.rank}</text>')
        parts.append(_bar([lane.window], "idle", start, scale, y))
        for kind, intervals in (("compute", lane.compute), ("communication", lane.communication),
                                ("waiting", lane.waiting)):
            parts.append(_bar(intervals, kind, start, scale, y))
        parts.extend(_collective_mark(name, interval, start, scale, y) for name, interval in lane.collectives)
    height = 8 + len(lanes) * _LANE_HEIGHT + 16
    axis = (f'<text x="{_LABEL}" y="{height - 4}" font-size="11">0</text>'
            f'<text x="{_WIDTH}" y="{height - 4}" font-size="11" text-anchor="end">{_seconds((end - start) / 1e9)}</text>')
    legend = " ".join(f'<span style="color:{colour}">&#9632;</span> {kind}' for kind, colour in _COLOURS.items())
    return (f'<svg class="fsdp2nb-timeline" width="{_WIDTH}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'{"".join(parts)}{axis}</svg><div style="font-size:12px">{legend}; collectives outlined</div>')


def _bar(intervals, kind: str, origin: int, scale: float, y: int) -> str:
    rects = []
    for left, right in _on_screen(intervals, origin, scale):
        rects.append(f'<rect x="{left:.1f}" y="{y}" width="{max(right - left, _MIN_PIXELS):.1f}" '
                     f'height="{_LANE_HEIGHT - 6}"/>')
    return f'<g fill="{_COLOURS[kind]}" class="{kind}">{"".join(rects)}</g>' if rects else ""


def _on_screen(intervals, origin: int, scale: float) -> list[tuple[float, float]]:
    """Intervals in pixels, those less than a pixel apart joined."""
    joined: list[tuple[float, float]] = []
    for start, end in intervals:
        left, right = _LABEL + (start - origin) * scale, _LABEL + (end - origin) * scale
        if joined and left - joined[-1][1] < _MIN_PIXELS:
            joined[-1] = (joined[-1][0], max(joined[-1][1], right))
        else:
            joined.append((left, right))
    return joined


def _collective_mark(name: str, interval: Interval, origin: int, scale: float, y: int) -> str:
    left = _LABEL + (interval[0] - origin) * scale
    width = (interval[1] - interval[0]) * scale
    if width < 1:  # too short to outline: its colour shows it
        return ""
    return (f'<rect x="{left:.1f}" y="{y}" width="{width:.1f}" height="{_LANE_HEIGHT - 6}" fill="none" '
            f'stroke="#333" stroke-width="0.6"><title>{escape(name)}</title></rect>')


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"
