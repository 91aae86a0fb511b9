"""The background-run handle's states and the queue of requests behind a run (no processes)."""

from __future__ import annotations

import threading

import pytest

from fsdp2nb.frontend.background import BackgroundRun, BackgroundRuns, StopRequests, check_run_name
from fsdp2nb.frontend.errors import RankError
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import CellFinished
from fsdp2nb.wire.records import ErrorInfo
from tests.support.fake_pools import FakePool


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(name: str | None = None, clock: FakeClock | None = None) -> BackgroundRun:
    return BackgroundRun(ranks=(0, 1), execution_count=12, name=name, clock=clock or FakeClock())


def _rank_error(ename: str) -> RankError:
    return RankError([(0, ErrorInfo(ename, "boom", ())), (1, ErrorInfo(ename, "boom", ()))], 2)


def test_a_run_goes_from_running_to_done_and_keeps_its_elapsed_time():
    clock = FakeClock()
    run = _run("train", clock)
    clock.now += 75
    assert run.state == "running" and not run.done() and run.elapsed_s == 75
    run.rank_finished(0, failed=False)
    assert run.rank_states == {0: "done", 1: "running"}
    run.rank_finished(1, failed=False)
    run.finish(None)
    clock.now += 1000
    assert run.state == "done" and run.done() and run.elapsed_s == 75
    assert run.wait(timeout=0) is True
    assert repr(run) == "<fsdp2 background run In[12] (train): done, 1:15; ranks: 2 done>"
    assert run.summary() == "background run In[12] (train) done 1:15"


def test_wait_times_out_on_a_running_run():
    run = BackgroundRun(ranks=(0,), execution_count=3)
    assert run.wait(timeout=0.0) is False


def test_wait_raises_the_error_and_then_it_is_seen():
    run = _run()
    error = _rank_error("ValueError")
    run.finish(error)
    assert run.state == "failed" and run.unseen_error() is error
    with pytest.raises(RankError) as raised:
        run.wait()
    assert raised.value is error and run.unseen_error() is None


def test_an_interrupt_asked_for_is_not_passed_on_but_an_unasked_one_is():
    asked, unasked = _run(), _run()
    asked.interrupt()
    assert asked.stops.take() is True and asked.stops.take() is False
    for run in (asked, unasked):
        run.finish(_rank_error("KeyboardInterrupt"))
        assert run.state == "interrupted"
    assert asked.unseen_error() is None
    assert unasked.unseen_error() is not None


def test_interrupt_after_the_end_sends_nothing():
    run = _run()
    run.finish(None)
    run.interrupt()
    assert run.stops.take() is False


def test_a_queued_request_fails_once_with_the_runs_error_saying_it_did_not_run():
    runs = BackgroundRuns()
    said: list[str] = []
    run = _run()
    runs.add(run)
    run.finish(_rank_error("ValueError"))
    with pytest.raises(RankError) as raised:
        runs.wait_for_active(said.append)
    assert said == []  # the run had ended: nothing to wait for
    assert "did not run" in raised.value.notes[-1] and raised.value.errors[0][1].ename == "ValueError"
    runs.wait_for_active(said.append)  # seen now: the next request goes ahead


def test_a_queued_request_waits_for_the_run_and_says_for_which():
    runs = BackgroundRuns()
    said: list[str] = []
    run = _run("train")
    runs.add(run)
    waiter = threading.Thread(target=runs.wait_for_active, args=(said.append,))
    waiter.start()
    run.finish(None)
    waiter.join()
    assert not said or said[0].startswith("waiting for In[12] (train), started ")
    assert runs.active is None


def test_finished_ranks_are_counted_by_the_handle():
    from fsdp2nb.frontend.request_wait import RequestWait

    run = _run()
    pool = FakePool(PoolSpec(devices=("cpu", "cpu")), with_ranks=False)
    wait = RequestWait(pool, 1, run.ranks, recover=lambda spec, what: "", ask_input=lambda prompt, password: "",
                       on_rank_finished=run.rank_finished)
    wait._handle(CellFinished(cell_id=1, rank=1, status="error", error=ErrorInfo("ValueError", "x", ())))
    assert wait.progress.running == [0] and run.rank_states == {0: "running", 1: "failed"}


def test_find_names_the_known_runs():
    runs = BackgroundRuns()
    with pytest.raises(ValueError, match="no background run yet"):
        runs.find(None)
    runs.add(_run("train"))
    assert runs.find("train").name == "train" and runs.find(None).name == "train"
    with pytest.raises(ValueError, match=r"no background run is called 'eval' \(named runs: train\)"):
        runs.find("eval")


@pytest.mark.parametrize("name", ["2fast", "for", "a b", ""])
def test_run_names_must_be_identifiers(name):
    with pytest.raises(ValueError, match="--name takes a Python identifier"):
        check_run_name(name)


def test_stop_requests_count_presses_from_any_thread():
    stops = StopRequests()
    threads = [threading.Thread(target=stops.press) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stops.take() is True and stops.take() is False


def test_a_run_taken_over_on_attach_counts_from_its_real_start_and_is_named_for_its_kernel():
    import time

    clock = FakeClock()
    run = BackgroundRun(ranks=(0, 1), execution_count=3, name="train", clock=clock,
                        started_at=time.time() - 50, origin="of kernel 4242")
    assert run.elapsed_s >= 50
    assert run.label == "In[3] of kernel 4242 (train)"
    assert run.summary().startswith("background run In[3] of kernel 4242 (train) running 0:5")


def test_a_prompt_relay_asks_only_while_a_cell_waits_and_hands_the_answer_over():
    from fsdp2nb.frontend.notebook_input import PromptRelay
    from fsdp2nb.frontend.rank_prompts import PromptDeferred

    asked: list[str] = []

    def ask(prompt: str, password: bool) -> str:
        asked.append(prompt)
        return "Ada"

    relay = PromptRelay(ask=ask)
    assert not relay.can_answer()
    with pytest.raises(PromptDeferred):
        relay.ask("[0] name? ", False)
    answers = []
    with relay.waiting():
        assert relay.can_answer()
        runner = threading.Thread(target=lambda: answers.append(relay.ask("[0] name? ", False)))
        runner.start()
        while runner.is_alive():
            relay.answer_pending()
            runner.join(0.01)
    assert answers == ["Ada"] and asked == ["[0] name? "]
    deferred = []

    def ask_then_leave() -> None:
        try:
            relay.ask("[0] again? ", False)
        except PromptDeferred:
            deferred.append(True)

    with relay.waiting():
        runner = threading.Thread(target=ask_then_leave)
        runner.start()
        runner.join(0.2)  # the waiting cell ends without answering (its stop button)
    runner.join(5)
    assert deferred == [True] and asked == ["[0] name? "]


def test_a_taken_over_run_says_how_it_ended_and_where_its_output_is():
    clock = FakeClock()
    run = BackgroundRun(ranks=(0, 1), execution_count=3, name="job", clock=clock, origin="of kernel 4242",
                        output_at="its output is under In[5], the attach cell, and in the rank logs in /logs/p")
    clock.now += 95
    run.rank_finished(0, failed=False)
    run.rank_finished(1, failed=True)
    run.finish(RankError([(1, ErrorInfo("ValueError", "boom", ()))], 2))
    assert run.ending_line() == ("In[3] of kernel 4242 (job) on ranks 0-1: failed on rank 1 after 1:35; "
                                 "its output is under In[5], the attach cell, and in the rank logs in /logs/p")


def test_a_run_that_ended_while_no_kernel_held_the_pool_is_timed_to_its_end_not_the_attach():
    import time

    clock, now = FakeClock(), time.time()
    run = BackgroundRun(ranks=(0,), execution_count=3, clock=clock, started_at=now - 60.5,
                        ended_at=now - 50, origin="of another kernel")
    run.rank_finished(0, failed=False)
    run.finish(None)  # its held reply came at the attach, 50 s after it ended
    assert run.elapsed_s == pytest.approx(10.5, abs=0.4)
    assert run.ending_line() == "In[3] of another kernel on rank 0: done after 0:10"
