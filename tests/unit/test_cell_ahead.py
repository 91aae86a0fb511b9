"""Plain `%%fsdp2` cells go to the ranks at `pre_run_cell` and the magic only waits for them; every
other cell is left to the magic. A stand-in session records what was sent and waited for; the
shell is IPython's own, so the bodies are those IPython hands the magic."""

from __future__ import annotations

import contextlib
import types

import pytest
from IPython.core.interactiveshell import ExecutionInfo, InteractiveShell

from fsdp2nb.frontend.cell_ahead import CellsAhead, plain_cell_body
from fsdp2nb.frontend.errors import CellSyntaxError
from fsdp2nb.frontend.magics import FSDP2Magics
from fsdp2nb.frontend.pool_requests import SentCell


class _Requests:
    """Stands in for the session's PoolRequests: records sends and waits; `refuse` is raised by a send."""

    def __init__(self, refuse: BaseException | None) -> None:
        self.refuse = refuse
        self.sent: list[tuple[str, tuple[int, ...], int | None]] = []
        self.finished: list[str] = []

    def send_cell(self, pool, code: str, ranks: tuple[int, ...], execution_count: int | None) -> SentCell:
        if self.refuse is not None:
            raise self.refuse
        self.sent.append((code, ranks, execution_count))
        return SentCell(wait=types.SimpleNamespace(pool=pool, code=code, cell_id=None),  # type: ignore[arg-type]
                        stop_button=contextlib.ExitStack())

    def finish_cell(self, sent: SentCell) -> None:
        self.finished.append(sent.wait.code)  # type: ignore[attr-defined]


class _Session:
    """Stands in for the NotebookSession: a pool ready for a cell or none, and the recording requests."""

    def __init__(self, ready: bool = True, refuse: BaseException | None = None) -> None:
        self.pool = types.SimpleNamespace(world_size=2) if ready else None
        self.dashboard = None
        self.requests = _Requests(refuse)

    def add_snapshot_listener(self, listener) -> None:
        """The magics hear the ranks' profiles through it; no pool here sends any."""

    def pool_ready_for_a_cell(self):
        return self.pool


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    callbacks = {event: list(shell.events.callbacks[event]) for event in ("pre_run_cell", "post_run_cell")}
    yield shell
    for event, before in callbacks.items():
        shell.events.callbacks[event][:] = before
    shell.magics_manager.magics["line"].pop("fsdp2", None)
    shell.magics_manager.magics["cell"].pop("fsdp2", None)
    shell.ast_transformers.clear()


def _listening(shell: InteractiveShell, session: _Session) -> CellsAhead:
    ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
    ahead.listen()
    shell.register_magics(FSDP2Magics(shell, session, ahead))  # type: ignore[arg-type]
    return ahead


def _announce(shell: InteractiveShell, ahead: CellsAhead, raw_cell: str) -> None:
    """What IPython does before compiling a cell: transform it, fire `pre_run_cell`."""
    info = ExecutionInfo(raw_cell, store_history=True, silent=False, shell_futures=True, cell_id=None,
                         transformed_cell=shell.transform_cell(raw_cell))
    ahead.send_ahead(info)


@pytest.mark.parametrize("body", ["print(rank)\n", "x = '%%fsdp2'  # \"quoted\" \\n\n", "é = 1\n\n\nprint(é)",
                                  "\n\n", "def f():\n    return 1\n"])
def test_the_body_sent_ahead_is_the_one_ipython_hands_the_magic(shell, body):
    session = _Session()
    _listening(shell, session)
    result = shell.run_cell(f"%%fsdp2\n{body}", store_history=True)
    given = body if body.endswith("\n") else body + "\n"  # IPython ends a cell with a newline
    assert result.success, result.error_in_exec
    assert session.requests.sent == [(given if given.strip() else "", (0, 1), result.execution_count)]
    assert session.requests.finished == [session.requests.sent[0][0]]  # the magic waited for it, once


@pytest.mark.parametrize("raw_cell", ["%%fsdp2", "%%fsdp2 --ranks 0\nprint(rank)", "%%fsdp2 --bg\nx = 1", "x = 1",
                                      "%%time\n%%fsdp2\nx = 1", "%fsdp2 status", "%%fsdp2?"])
def test_cells_with_options_or_other_magics_are_left_to_the_magic(shell, raw_cell):
    session = _Session()
    ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
    _announce(shell, ahead, raw_cell)
    assert session.requests.sent == [] and ahead.claim("", "x = 1\n") is None


def test_nothing_is_sent_ahead_without_a_ready_pool_or_with_a_users_ast_transformer(shell):
    for session, transformers in ((_Session(ready=False), []), (_Session(), [object()])):
        shell.ast_transformers[:] = transformers
        ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
        _announce(shell, ahead, "%%fsdp2\nx = 1")
        assert session.requests.sent == [] and ahead.claim("", "x = 1\n") is None


def test_a_body_that_does_not_parse_is_left_to_the_magic(shell):
    session = _Session(refuse=CellSyntaxError(SyntaxError("invalid syntax")))
    ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
    _announce(shell, ahead, "%%fsdp2\nthis is not python")
    assert ahead.claim("", "this is not python\n") is None  # the magic transforms and reports it


def test_what_the_send_raised_is_raised_by_the_magic_for_that_cell(shell):
    lost = ConnectionError("rank 1 is not connected to the pool")
    session = _Session(refuse=lost)
    ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
    _announce(shell, ahead, "%%fsdp2\nx = 1")
    with pytest.raises(ConnectionError) as raised:
        ahead.claim("", "x = 1\n")
    assert raised.value is lost
    assert ahead.claim("", "x = 1\n") is None  # raised once, for that cell only


def test_a_cell_sent_ahead_is_waited_for_before_a_magic_call_for_another(shell):
    session = _Session()
    ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
    _announce(shell, ahead, "%%fsdp2\nx = 1")
    assert ahead.claim("--ranks 0", "x = 1\n") is None
    assert session.requests.finished == ["x = 1\n"]


def test_a_cell_sent_ahead_whose_magic_never_ran_is_waited_for_when_the_cell_ends(shell):
    session = _Session()
    ahead = CellsAhead(shell, session)  # type: ignore[arg-type]
    _announce(shell, ahead, "%%fsdp2\nx = 1")
    ahead.finish_unclaimed(None)  # type: ignore[arg-type]
    ahead.finish_unclaimed(None)  # type: ignore[arg-type]
    assert session.requests.finished == ["x = 1\n"]
    assert ahead.claim("", "x = 1\n") is None


def test_plain_cell_body_reads_only_a_single_call_of_the_cell_magic():
    assert plain_cell_body("get_ipython().run_cell_magic('fsdp2', '', 'x = 1\\n')\n") == "x = 1\n"
    assert plain_cell_body("get_ipython().run_cell_magic('fsdp2', '', 'x')\nprint(2)\n") is None
    assert plain_cell_body("get_ipython().run_cell_magic('fsdp2', '', 'a'), f('b')\n") is None
    assert plain_cell_body("get_ipython().run_cell_magic('fsdp2', '', 1)\n") is None
    assert plain_cell_body(None) is None and plain_cell_body("") is None
