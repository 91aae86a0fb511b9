"""The session model-checker's shrinking, proven on a stand-in notebook: the same machine and the
same `check_seeds` as the real-kernel runs (tests/support/session_model.py), with a session that
runs no cells and carries a planted defect, so that what shrinking must find is known exactly.

Shrinking does not depend on what executes an action: Hypothesis replays shorter choice sequences
through `SessionMachine`, and a sequence fails or not. The planted defect breaks an invariant once
two particular actions have both happened, in either order and however far apart, so the shortest
failing session is exactly those two actions.
"""

from __future__ import annotations

from tests.support.session_model import InvariantBroken, Tally, check_seeds

PLANTED = ("kill the host agent", "snapshots")
"""The two actions whose meeting breaks the planted invariant (`snapshots` with either argument)."""


class SessionWithPlantedDefect:
    """Stands in for `Session`: every action only notes itself (the machine notes each one before
    calling it), and the disk check fails once both planted actions are among those noted."""

    def __init__(self, tally: Tally, *, kept: bool) -> None:
        self.tally, self.kept = tally, kept
        self.done: list[str] = []
        tally.sessions += 1

    def note(self, action: str) -> None:
        self.done.append(action)

    def check_disk(self) -> None:
        if all(any(action.startswith(name) for action in self.done) for name in PLANTED):
            raise InvariantBroken(f"planted: {' and '.join(PLANTED)} both happened")

    def check_resources(self) -> None:
        pass

    def close(self) -> list[str]:
        return []

    def loadable_steps(self) -> list[int]:
        return [2]

    def train(self, num_steps: int, save_mode: str, *, first: int | None = None, background: bool = False) -> None:
        pass

    def _nothing(self, *args) -> None:
        pass

    save_now = wait = load_step = load_latest = load_memory = set_snapshots = _nothing
    raise_in_collective = interrupt_in_collective = kill_rank_in_cell = kill_rank_between_cells = _nothing
    kill_agent = restart = detach_attach = _nothing


def action_names(actions: tuple[str, ...]) -> list[str]:
    """'snapshots True' -> 'snapshots'; 'train 3 steps, save sync' -> 'train'."""
    return [next((name for name in PLANTED if action.startswith(name)), action.split(" ")[0]) for action in actions]


def test_a_failing_session_is_shrunk_to_the_two_actions_that_break_it():
    tally, failures = check_seeds(58, 3, actions=40, examples=30, shrink=True, session_type=SessionWithPlantedDefect)
    assert len(failures) == 3, failures  # every seed found the planted defect
    for session_seed in (58, 59, 60):
        noted = [violation for violation in tally.violations if violation.seed == session_seed]
        first, shortest = noted[0], min(noted, key=lambda violation: len(violation.actions))
        assert len(first.actions) > 2, first  # the failure found at first carries actions the defect does not need
        assert sorted(action_names(shortest.actions)) == sorted(PLANTED), shortest
    assert all("shrunk to 2 actions" in failure for failure in failures), failures


def test_without_shrinking_the_first_failing_session_is_reported_as_it_was():
    tally, failures = check_seeds(58, 1, actions=40, examples=30, shrink=False, session_type=SessionWithPlantedDefect)
    assert len(failures) == 1 and "shrunk" not in failures[0], failures
    assert len({violation.actions for violation in tally.violations}) == 1, tally.violations  # replayed as it was
    assert len(tally.violations[0].actions) > 2, tally.violations
