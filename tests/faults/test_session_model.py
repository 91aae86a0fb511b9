"""The seeded model-checker of whole sessions (tests/support/session_model.py): Hypothesis drives a
real kernel and a 2-rank CPU pool through random actions of a user and checks after each one that
saves, LATEST and restores agree with a reference lineage of states, that no cell runs past its
timeout and that nothing of the session is left over.

A short seeded session runs with the suite; the soak variant (marked soak, `make soak`) runs several
seeds of several sessions each and prints the counts. Seed, number of actions, sessions per seed
and shrinking (on unless turned off) come from `--session-*` options or FSDP2NB_SESSION_* variables
(tests/faults/conftest.py). Shrinking replays shorter sessions only after one failed, and Hypothesis
bounds its time.
"""

from __future__ import annotations

import os
import re
import threading

import pytest

from fsdp2nb.checkpoint import layout
from tests.support.kernel_client import CellRun
from tests.support.rank_resources import (
    FDS_PER_GLOO_DEVICE,
    MORE_PLAIN_THREADS,
    REPLACED_CHECKPOINTER_DEVICES,
)
from tests.support.session_model import (
    KNOWN_DEFECTS,
    InvariantBroken,
    Lineage,
    SavedStep,
    Session,
    Tally,
    check_seeds,
)


def session_option(config: pytest.Config, name: str, default):
    """The option `--session-NAME`, else FSDP2NB_SESSION_NAME, else `default`."""
    value = config.getoption(f"--session-{name}", default=None)
    if value is not None:
        return value
    text = os.environ.get(f"FSDP2NB_SESSION_{name.upper()}")
    if text is None:
        return default
    if isinstance(default, bool):
        return text not in ("", "0", "no")
    try:
        return type(default)(text)
    except ValueError:
        raise pytest.UsageError(f"FSDP2NB_SESSION_{name.upper()}={text!r}: give a whole number") from None


SHORT_SEED = 11
SHORT_ACTIONS = 6
"""Its session: a sync save, `%fsdp2 restart`, a rank raising in a collective, a load of memory and
one of LATEST: a restore of each kind, a fault that re-forms the groups and the holdings' check on
fresh ranks, in 10-30 s on a 2-core machine (the kernel's and pool's start included)."""


def _report(tally: Tally, failures: list[str]) -> None:
    print(tally.table())
    if KNOWN_DEFECTS:
        print("known defects, steered around:")
        for name, defect in KNOWN_DEFECTS.items():
            print(f"  {name} (seed {defect.seed}, {defect.run}): {defect.action}; breaks: {defect.invariant}")
    assert not failures, "\n".join([tally.table(), *failures])


@pytest.mark.timeout(900)  # a failure is replayed shorter for up to Hypothesis's 300 s of shrinking
def test_a_short_seeded_session_keeps_saves_restores_and_leaves_nothing(pytestconfig):
    tally, failures = check_seeds(session_option(pytestconfig, "seed", SHORT_SEED), 1,
                                  actions=session_option(pytestconfig, "actions", SHORT_ACTIONS), examples=1,
                                  shrink=session_option(pytestconfig, "shrink", True))
    _report(tally, failures)
    assert sum(tally.actions.values()) >= 1, tally.table()
    assert tally.cells > sum(tally.actions.values()), tally.table()  # every action ran cells


@pytest.mark.soak
@pytest.mark.timeout(0)  # every cell has a timeout of its own
def test_seeded_sessions_soak(pytestconfig):
    tally, failures = check_seeds(session_option(pytestconfig, "seed", SHORT_SEED),
                                  session_option(pytestconfig, "seeds", 5),
                                  actions=session_option(pytestconfig, "actions", 100),
                                  examples=session_option(pytestconfig, "examples", 8),
                                  shrink=session_option(pytestconfig, "shrink", True))
    _report(tally, failures)


# ---- the checker's own invariants, without a kernel -------------------------------------------

def _session_without_kernel() -> Session:
    return Session(Tally(), kept=False, start=False, log=lambda line: None)


def test_the_same_path_with_another_digest_breaks_the_lineage():
    lineage = Lineage()
    step_0 = lineage.child(0, 0)
    lineage.observe(step_0, {0: "aa", 1: "bb"}, "first training")
    assert lineage.child(0, 0) == step_0  # the same path is the same node
    lineage.observe(step_0, {1: "bb"}, "one rank again")
    with pytest.raises(InvariantBroken, match="differ from"):
        lineage.observe(step_0, {0: "aa", 1: "cc"}, "a restore")


def test_latest_older_than_the_last_save_reported_done_breaks_an_invariant():
    session = _session_without_kernel()
    try:
        session.saves = [SavedStep(step=3, node=0, cell=4, outcome="done"),
                         SavedStep(step=5, node=0, cell=6, outcome="done")]
        (session.ckpt_dir / layout.LATEST_FILE).write_text(layout.step_dir_name(3) + "\n")
        with pytest.raises(InvariantBroken, match="LATEST names step 3, but the last save reported done was step 5"):
            session.check_disk()
        session.saves.append(SavedStep(step=3, node=0, cell=7))  # a later save of step 3, still pending
        session.check_disk()  # LATEST may name it: it was asked after
    finally:
        session.close()


def test_a_failed_save_said_two_cells_late_breaks_an_invariant():
    session = _session_without_kernel()
    try:
        session.saves = [SavedStep(step=2, node=0, cell=1)]
        session.num_cells = 3
        failed = CellRun(status="error", messages=[{"msg_type": "stream", "content": {
            "name": "stderr", "text": "rank 0: an earlier background save failed (see the rank that reports it)"}}])
        with pytest.raises(InvariantBroken, match="said to have failed only in cell 3"):
            session._note_save_failures(failed)
        assert session.saves[0].outcome == "failed"
    finally:
        session.close()


def test_a_rank_holding_more_threads_and_descriptors_than_after_its_set_up_breaks_an_invariant():
    """Measured from outside, on a process standing in for a rank (this one)."""
    session = _session_without_kernel()
    release = threading.Event()
    threads = [threading.Thread(target=release.wait) for _ in range(MORE_PLAIN_THREADS + 1)]
    pipes: list[int] = []
    try:
        session.rank_pids = {0: os.getpid()}
        session._take_baselines()
        with open(session.ckpt_dir / "in-flight.distcp", "wb"):
            session.check_resources()  # one file of a save in flight is allowed
        for thread in threads:
            thread.start()
        for _ in range(REPLACED_CHECKPOINTER_DEVICES * FDS_PER_GLOO_DEVICE // 2 + 1):  # two fds each
            pipes.extend(os.pipe())
        with pytest.raises(InvariantBroken) as broken:
            session.check_resources()
        message = str(broken.value)
        assert f"rank 0 (pid {os.getpid()}) grew" in message
        assert "other threads" in message and "sockets, pipes and epolls" in message
        assert re.search(r"now \d+ threads \(.*\) and \d+ fds \(.*pipe \d+", message), message
    finally:
        release.set()
        for thread in threads:
            if thread.is_alive():
                thread.join()
        for fd in pipes:
            os.close(fd)
        session.close()
