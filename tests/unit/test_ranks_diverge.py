"""`released_collectives.ranks_diverge`: when sampled positions say a collective was not entered by
every rank."""

from fsdp2nb.frontend.cell_progress import CellProgress
from fsdp2nb.frontend.released_collectives import ranks_diverge
from fsdp2nb.wire.events import RankActivity

LINE = "In[5] line 6: dist.all_reduce(t)"


def _progress(*activities: RankActivity) -> CellProgress:
    progress = CellProgress(ranks=tuple(activity.rank for activity in activities))
    progress.activity = {activity.rank: activity for activity in activities}
    return progress


def test_a_rank_between_two_calls_of_the_same_collective_does_not_diverge():
    progress = _progress(RankActivity(0, 1, LINE), RankActivity(1, 1, LINE, collective="all_reduce"))
    assert not ranks_diverge(progress, world_size=2)


def test_a_rank_on_another_line_while_the_other_waits_in_a_collective_diverges():
    progress = _progress(RankActivity(0, 1, "In[5] line 3: raise ValueError()"),
                         RankActivity(1, 1, LINE, collective="all_reduce"))
    assert ranks_diverge(progress, world_size=2)


def test_ranks_in_different_collectives_diverge_and_ranks_computing_do_not():
    assert ranks_diverge(_progress(RankActivity(0, 1, LINE, collective="all_reduce"),
                                   RankActivity(1, 1, "In[5] line 7: dist.barrier()", collective="barrier")), 2)
    assert not ranks_diverge(_progress(RankActivity(0, 1, "In[5] line 2: x = 1"), RankActivity(1, 1, LINE)), 2)
