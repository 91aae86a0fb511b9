"""A `%%fsdp2` cell sent to the ranks as soon as IPython announces it, so that they run it while
the kernel compiles the cell and calls the magic.

IPython fires `pre_run_cell` with the cell as its input transformations left it; a `%%fsdp2` cell
without options is then one call, `run_cell_magic('fsdp2', '', body)`. Where the pool can take a
cell at once (`NotebookSession.pool_ready_for_a_cell`: nothing to start, replace or wait for
first), the body is sent then; the magic, called with that same body, only waits for the replies.
Every other cell (options, no pool yet, a background run going, a body that does not parse, a
shell with AST transformers of its user's, which may reject or rewrite the call) is left to the
magic, which does what it always did, in the same order.

Should the magic of a cell sent ahead not run after all (an error in IPython between the event and
the call), the cell is waited for when it ends (`post_run_cell`), so that its replies never reach a
later cell.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp2nb.frontend.errors import CellSyntaxError

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

    from fsdp2nb.frontend.pool_requests import SentCell
    from fsdp2nb.frontend.session import NotebookSession

_PLAIN_CELL_CALL = "get_ipython().run_cell_magic('fsdp2', '', "
"""How IPython's transformations begin a `%%fsdp2` cell without options; the body's repr and `)`
follow."""


@dataclass(frozen=True, slots=True)
class _Ahead:
    body: str
    """The cell's body as the magic will be given it."""
    sent: SentCell | None
    error: BaseException | None
    """What the send raised (a rank found gone: the pool was recovered), for the magic to raise."""


class CellsAhead:
    """Sends plain `%%fsdp2` cells at `pre_run_cell`; the magic claims them (`claim`)."""

    def __init__(self, shell: InteractiveShell, session: NotebookSession) -> None:
        self._shell = shell
        self._session = session
        self._ahead: _Ahead | None = None

    def listen(self) -> None:
        """Register with the shell's events; once per shell (the extension's first load)."""
        self._shell.events.register("pre_run_cell", self.send_ahead)
        self._shell.events.register("post_run_cell", self.finish_unclaimed)

    def send_ahead(self, info: ExecutionInfo) -> None:
        body = plain_cell_body(getattr(info, "transformed_cell", None))
        if not body or self._ahead is not None or self._shell.ast_transformers:
            return  # IPython refuses an empty body; a user's AST transformer may reject or change the call
        pool = self._session.pool_ready_for_a_cell()
        if pool is None:
            return
        code = body if body.strip() else ""
        count = self._shell.execution_count - 1 if info.store_history else self._shell.execution_count
        try:
            sent = self._session.requests.send_cell(pool, code, tuple(range(pool.world_size)), count)
        except CellSyntaxError:
            return  # nothing sent: the magic reports it, as for any cell
        except Exception as error:  # the cell's outcome (a rank gone): the magic raises it
            self._ahead = _Ahead(body, None, error)
            return
        self._ahead = _Ahead(body, sent, None)

    def claim(self, line: str, cell: str | None) -> SentCell | None:
        """The cell sent ahead, where the magic was called for it (`cell` the body sent, no
        options); it raises what sending it raised. Any other call finishes a cell sent ahead
        first, so the replies of one cell never reach another."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if line.strip() or cell != ahead.body:
            if ahead.sent is not None:
                self._session.requests.finish_cell(ahead.sent)
            return None
        if ahead.error is not None:
            raise ahead.error
        return ahead.sent

    def finish_unclaimed(self, result: ExecutionResult) -> None:
        """A cell sent ahead whose magic never ran: wait for its replies now, showing its errors."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.sent is None:
            return
        try:
            self._session.requests.finish_cell(ahead.sent)
        except Exception:
            self._shell.showtraceback()


def plain_cell_body(transformed: str | None) -> str | None:
    """The body of a `%%fsdp2` cell without options, from IPython's transformed cell; None for
    any other cell."""
    if not transformed or not transformed.startswith(_PLAIN_CELL_CALL) or not transformed.endswith(")\n"):
        return None
    try:
        body = ast.literal_eval(transformed[len(_PLAIN_CELL_CALL):-2])
    except (ValueError, SyntaxError, MemoryError, RecursionError):  # more than one string literal follows
        return None
    return body if isinstance(body, str) else None
