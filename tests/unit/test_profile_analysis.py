"""The torch-free analysis of ranks' profiles: rows whose parts add up, waiting measured from the
latest arrival, the straggler, self times, and the merged trace on one clock."""

import json

import pytest

from fsdp2nb.frontend.profile_view import render_html
from fsdp2nb.profile_analysis import analyse, merged_trace
from fsdp2nb.profile_records import COLLECTIVE, OP, pack
from fsdp2nb.wire.events import RankProfile

MS = 1_000_000
MAIN, GLOO = 0, 1
NAMES = ("aten::mm", "aten::add", "gloo:all_reduce")


def _profile(rank: int, ops: list[tuple[int, int, int, int, int]], *, start: int = 0, end: int = 100 * MS,
             offset: int = 0) -> RankProfile:
    """`ops`: (name index, lane, kind, start, duration), in ns on the rank's clock."""
    return RankProfile(rank=rank, cell_id=7, device="cpu", start_ns=start, end_ns=end, names=NAMES,
                       ops=pack([value for op in ops for value in op]), main_lane=MAIN, clock_offset_ns=offset)


def _late_rank_pool(delay: int = 20 * MS) -> list[RankProfile]:
    """Ranks 0 and 2 enter an all_reduce at 10 ms; rank 1 computes until 10 ms + delay."""
    early = [(0, MAIN, OP, 0, 10 * MS), (2, GLOO, COLLECTIVE, 10 * MS, delay + 5 * MS)]
    late = [(0, MAIN, OP, 0, 10 * MS + delay), (2, GLOO, COLLECTIVE, 10 * MS + delay, 5 * MS)]
    return [_profile(0, early), _profile(1, late), _profile(2, early)]


def test_the_late_rank_is_the_straggler_and_the_others_wait_from_their_start_to_its():
    analysis = analyse(_late_rank_pool())
    assert analysis.straggler == 1
    assert analysis.waited_for_s == pytest.approx(0.040)  # two ranks, 20 ms each
    waiting = {row.rank: row.waiting_s for row in analysis.rows}
    assert waiting == {0: pytest.approx(0.020), 1: 0.0, 2: pytest.approx(0.020)}


def test_each_rows_parts_add_up_to_its_wall_time():
    for row in analyse(_late_rank_pool()).rows:
        assert row.compute_s + row.communication_s + row.idle_s == pytest.approx(row.wall_s)
        assert row.waiting_s <= row.communication_s
    early = analyse(_late_rank_pool()).rows[0]
    assert (early.compute_s, early.communication_s, early.idle_s) == pytest.approx((0.010, 0.025, 0.065))


def test_communication_beside_compute_counts_as_overlapped_not_communication():
    ops = [(0, MAIN, OP, 0, 30 * MS), (2, GLOO, COLLECTIVE, 10 * MS, 40 * MS)]
    row = analyse([_profile(0, ops), _profile(1, ops)]).rows[0]
    assert row.compute_s == pytest.approx(0.030) and row.communication_s == pytest.approx(0.020)
    assert row.overlapped_s == pytest.approx(0.020) and row.overlapped_share == pytest.approx(0.5)


def test_no_rank_waited_no_straggler():
    together = [(2, GLOO, COLLECTIVE, 10 * MS, 5 * MS)]
    analysis = analyse([_profile(0, together), _profile(1, together)])
    assert analysis.straggler is None and all(row.waiting_s == 0 for row in analysis.rows)
    assert "no rank waited" in render_html(analysis)


def test_a_rank_that_began_recording_late_is_no_straggler_of_the_cell():
    """Waiting counts from when every rank records: the cell reached rank 1 20 ms late."""
    early = [(2, GLOO, COLLECTIVE, 1 * MS, 25 * MS)]
    late = [(2, GLOO, COLLECTIVE, 21 * MS, 5 * MS)]
    analysis = analyse([_profile(0, early), _profile(1, late, start=21 * MS)])
    assert analysis.straggler is None


def test_self_time_leaves_out_nested_ops():
    nested = [(0, MAIN, OP, 0, 10 * MS), (1, MAIN, OP, 2 * MS, 3 * MS)]
    ops = {op.name: op for op in analyse([_profile(0, nested)]).top_ops}
    assert ops["aten::mm"].self_s == pytest.approx(0.007) and ops["aten::mm"].total_s == pytest.approx(0.010)
    assert ops["aten::add"].self_s == pytest.approx(0.003)


def test_self_time_is_the_same_whatever_order_the_ops_come_in():
    """Ops nested on two lanes, given inner first and lanes interleaved, as a GPU rank's may come."""
    ops = [(1, MAIN, OP, 2 * MS, 3 * MS), (1, GLOO, OP, 1 * MS, 1 * MS), (0, MAIN, OP, 2 * MS, 10 * MS),
           (0, GLOO, OP, 0, 4 * MS)]
    top = {op.name: op for op in analyse([_profile(0, ops)]).top_ops}
    assert top["aten::mm"].self_s == pytest.approx(0.007 + 0.003) and top["aten::mm"].total_s == pytest.approx(0.014)
    assert top["aten::add"].self_s == pytest.approx(0.004) and top["aten::add"].calls == 2


def test_clock_offsets_put_the_ranks_on_one_clock():
    """Rank 1's clock runs 1 s ahead: with its offset the collective's ends line up."""
    collective = [(2, GLOO, COLLECTIVE, 10 * MS, 5 * MS)]
    ahead = [(2, GLOO, COLLECTIVE, 1000 * MS + 12 * MS, 3 * MS)]
    profiles = [_profile(0, collective), _profile(1, ahead, start=1000 * MS, end=1100 * MS, offset=-1000 * MS)]
    assert analyse(profiles).straggler == 1
    trace = json.loads(json.dumps(merged_trace(profiles)))
    ends = [event["ts"] + event["dur"] for event in trace["traceEvents"] if event.get("cat") == "collective"]
    assert ends == pytest.approx([15_000, 15_000])
    assert {event["pid"] for event in trace["traceEvents"] if event["name"] == "process_name"} == {0, 1}


def test_offsets_measured_for_other_hosts_apply_to_the_profiles_taken():
    from fsdp2nb.frontend.profiles import ProfileCollector

    collector = ProfileCollector()
    collective = [(2, GLOO, COLLECTIVE, 10 * MS, 5 * MS)]
    collector.hear(_profile(0, collective))
    collector.hear(_profile(1, [(2, GLOO, COLLECTIVE, 1012 * MS, 3 * MS)], start=1000 * MS, end=1100 * MS))
    (profile,) = collector.take_new({0: (0, 0), 1: (-1000 * MS, 2 * MS)})
    assert profile.clocks == {0: (0.0, 0.0), 1: (-1.0, 0.002)}
    assert profile.straggler == 1 and profile.analysis.clock_error_s == pytest.approx(0.002)
    assert "Clocks agree within 2.0 ms" in render_html(profile.analysis)


def test_the_analysis_reads_the_ranks_sums_not_their_ops():
    """A rank sends its sums beside its ops: the kernel's analysis needs the sums alone."""
    from dataclasses import replace

    from fsdp2nb.profile_analysis import summarise
    from fsdp2nb.profile_records import unpack_flat

    summed = [summarise(profile, unpack_flat(profile.ops)) for profile in _late_rank_pool()]
    analysis = analyse([replace(profile, ops=b"") for profile in summed])
    assert analysis.straggler == 1 and analysis.waited_for_s == pytest.approx(0.040)
    assert analysis.rows[0].compute_s == pytest.approx(0.010) and analysis.rows[0].communication_s == pytest.approx(0.025)
    assert {op.name: op.calls for op in analysis.top_ops} == {"aten::mm": 3, "gloo:all_reduce": 3}
