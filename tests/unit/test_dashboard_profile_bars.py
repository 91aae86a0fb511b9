"""The dashboard's rows carry the last profile's split of each rank's time, drawn as a bar
beside the memory: parts in proportion, the straggler outlined, nothing before any profile."""

import re

from fsdp2nb.profile_analysis import ProfileAnalysis, RankRow
from fsdp2nb.widgets.markup import rank_row_html
from fsdp2nb.widgets.model import DashboardModel, PoolFacts


def _analysis() -> ProfileAnalysis:
    rows = (RankRow(rank=0, device="cpu", wall_s=1.0, compute_s=0.25, communication_s=0.5, waiting_s=0.25,
                    idle_s=0.25, overlapped_s=0.0),
            RankRow(rank=1, device="cpu", wall_s=1.0, compute_s=0.5, communication_s=0.0, waiting_s=0.0,
                    idle_s=0.5, overlapped_s=0.0))
    return ProfileAnalysis(cell_id=3, rows=rows, straggler=1, waited_for_s=0.25, top_ops=(), lanes=(),
                           clock_error_s=0.0)


def _widths(html: str) -> dict[str, float]:
    return {kind: float(width) for kind, width in
            re.findall(r'class="fsdp2nb-time-(\w+)" x="[\d.]+" width="([\d.]+)"', html)}


def test_rows_draw_the_last_profiles_split_and_outline_the_straggler():
    model = DashboardModel()
    model.set_facts(PoolFacts(state="ready", world_size=2))
    assert all(row.time_split is None and "fsdp2nb-time" not in rank_row_html(row) for row in model.rows())
    model.observe(_analysis())
    first, second = (rank_row_html(row) for row in model.rows())
    assert _widths(first) == {"compute": 26.0, "communication": 26.0, "waiting": 26.0, "idle": 26.0}
    assert _widths(second) == {"compute": 52.0, "communication": 0.0, "waiting": 0.0, "idle": 52.0}
    assert 'stroke="#d62728"' in second and 'stroke="#d62728"' not in first
    assert "the straggler" in second
