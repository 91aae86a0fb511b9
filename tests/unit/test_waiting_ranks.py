"""The rule that decides whether a rank waits in a collective, on synthetic samples: a loop of
collectives, however uneven, never waits; a rank whose count stalls while another is elsewhere or
ahead does."""

from fsdp2nb.frontend.waiting_ranks import STALLED_AFTER_S, CollectiveCounts, rank_waits
from fsdp2nb.wire.events import RankActivity

LOOP_LINE = "In[5] line 6: dist.all_reduce(t)"
NEXT_LINE = "In[5] line 7: if t[0] > 0:"


def _sample(rank: int, at: float, count: int | None, collective: str | None = "all_reduce",
            where: str = LOOP_LINE) -> RankActivity:
    return RankActivity(rank=rank, cell_id=5, where=where, collective=collective, num_collectives=count,
                        sampled_at=at)


def _judge(*rounds: list[RankActivity], all_ranks_run: bool = True) -> list[bool | None]:
    """Feed rounds of samples as the kernel would; the decision after each round."""
    counts, activity, decisions = CollectiveCounts(), {}, []
    for samples in rounds:
        for sample in samples:
            counts.note(sample)
            activity[sample.rank] = sample
        decisions.append(rank_waits(sorted(activity), activity, counts, all_ranks_run=all_ranks_run))
    return decisions


def test_a_loop_caught_at_the_same_positions_twice_does_not_wait():
    # The sampled case of issue 62: rank 1 in all_reduce, rank 0 on the next line, both times.
    first = [_sample(0, 100.0, 40, None, NEXT_LINE), _sample(1, 200.0, 40)]
    second = [_sample(0, 102.0, 71, None, NEXT_LINE), _sample(1, 202.0, 71)]
    assert _judge(first, second) == [False, False]


def test_a_rank_stalled_in_a_collective_while_another_computes_waits():
    first = [_sample(0, 100.0, 3), _sample(1, 200.0, 2, None, NEXT_LINE)]
    second = [_sample(0, 102.0, 3), _sample(1, 202.0, 2, None, NEXT_LINE)]
    assert _judge(first, second) == [False, True]


def test_a_stall_shorter_than_the_threshold_by_the_ranks_clock_does_not_wait():
    # The kernel's second ask arrived late: the samples lie closer together than it thinks.
    first = [_sample(0, 100.0, 3), _sample(1, 200.0, 2, None, NEXT_LINE)]
    second = [_sample(0, 100.0 + STALLED_AFTER_S / 2, 3), _sample(1, 201.0, 2, None, NEXT_LINE)]
    third = [_sample(0, 100.0 + STALLED_AFTER_S, 3), _sample(1, 202.0, 2, None, NEXT_LINE)]
    assert _judge(first, second, third) == [False, False, True]


def test_ranks_all_in_one_slow_collective_do_not_wait():
    rounds = [[_sample(0, 100.0 + t, 9), _sample(1, 200.0 + t, 9)] for t in (0.0, 2.0, 4.0)]
    assert _judge(*rounds) == [False, False, False]


def test_a_rank_ahead_in_the_same_collective_makes_the_stalled_one_wait():
    # Same call on the same line, but rank 1 entered one collective more: they are in different ones.
    rounds = [[_sample(0, 100.0 + t, 9), _sample(1, 200.0 + t, 10)] for t in (0.0, 2.0)]
    assert _judge(*rounds) == [False, True]


def test_a_rank_in_another_collective_makes_the_stalled_one_wait():
    rounds = [[_sample(0, 100.0 + t, 4), _sample(1, 200.0 + t, 4, "broadcast")] for t in (0.0, 2.0)]
    assert _judge(*rounds) == [False, True]


def test_a_stalled_rank_waits_for_ranks_left_out_of_the_cell():
    rounds = [[_sample(1, 100.0 + t, 1)] for t in (0.0, 2.0)]
    assert _judge(*rounds, all_ranks_run=False) == [False, True]


def test_ranks_that_do_not_count_leave_the_decision_to_positions():
    rounds = [[_sample(0, 100.0 + t, None), _sample(1, 200.0 + t, None, None, NEXT_LINE)] for t in (0.0, 2.0)]
    assert _judge(*rounds) == [None, None]


def test_a_rank_not_sampled_yet_leaves_the_decision_to_positions():
    counts, first = CollectiveCounts(), _sample(0, 100.0, 3)
    counts.note(first)
    assert rank_waits([0, 1], {0: first}, counts, all_ranks_run=True) is None


def test_a_count_that_moves_is_a_new_collective():
    counts = CollectiveCounts()
    assert counts.note(_sample(0, 100.0, 3)) is False  # the first sample: nothing to compare
    assert counts.note(_sample(0, 102.0, 3)) is False
    assert counts.note(_sample(0, 104.0, 4)) is True
    assert not counts.stalled(_sample(0, 105.0, 4))
    assert counts.stalled(_sample(0, 104.0 + STALLED_AFTER_S, 4))
    assert not counts.stalled(_sample(0, 110.0, 4, None, NEXT_LINE))  # out of the collective: not stalled


def test_only_the_main_threads_collectives_count():
    """The count goes with the main thread's stack sample: a save thread's collectives do not move it."""
    import threading

    from fsdp2nb.worker.collective_count import note_entered, num_entered

    before = num_entered()
    note_entered()
    save_thread = threading.Thread(target=note_entered)
    save_thread.start()
    save_thread.join()
    assert num_entered() == before + 1
