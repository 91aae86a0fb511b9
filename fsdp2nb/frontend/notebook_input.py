"""Lines of input for the ranks, asked of the notebook: what `RequestWait` calls when a rank's
input(), getpass or debugger prompt waits.

A blocking cell asks the frontend as a plain cell's input() does: ipykernel has replaced
`input` and `getpass.getpass` for the cell with its own, which send an `input_request` (and
raise StdinNotImplementedError where the frontend takes no input, as nbclient). A background
run's cell has returned, so nothing can answer it: its prompt is refused at once. A kept pool's
run that a kernel took over on attach had its cell in a kernel that is gone: its prompts wait
until a cell of this kernel waits for the run (`%fsdp2 wait`), and are asked there (PromptRelay).
"""

from __future__ import annotations

import contextlib
import getpass
import sys
import threading
from collections.abc import Callable, Iterator

from fsdp2nb.errors import Fsdp2nbError
from fsdp2nb.host.sigint import sigint_raises

AskLine = Callable[[str, bool], str]
"""(prompt, password) -> the line typed."""


class NoInputBox(Fsdp2nbError, RuntimeError):
    """No one can answer a rank's prompt; the message says why and what to do."""


def ask_notebook(prompt: str, password: bool) -> str:
    """The line the user types at `prompt` (hidden where `password`); the stop button raises
    KeyboardInterrupt here, as it does at a plain cell's input()."""
    with sigint_raises():
        return getpass.getpass(prompt) if password else input(prompt)


def refuse_in_background(prompt: str, password: bool) -> str:
    raise NoInputBox("it runs in the background (--bg), whose cell has returned, so no input box can answer; "
                     "run the cell without --bg to use input() or pdb there")


class PromptRelay:
    """The prompts of a run taken over on attach, asked in the cell that waits for the run.

    The run's runner thread calls `can_answer` and `ask` (as its RequestWait's `before_prompt`
    and `ask_input`); the kernel's main thread, while a cell waits for the run, enters
    `waiting()` and calls `answer_pending` now and then, which shows the prompt in that cell."""

    def __init__(self, ask: AskLine | None = None) -> None:
        self._ask = ask or ask_notebook
        """Asks the waiting cell for a line (the notebook's input box)."""
        self._changed = threading.Condition()
        self._waiter: dict | None = None
        """The parent header of the cell that waits for the run, while one does."""
        self._question: tuple[str, bool] | None = None
        self._reply: str | BaseException | None = None
        self._output_parent: dict | None = None

    # --- the waiting cell (the kernel's main thread) ----------------------------------------------

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        with self._changed:
            self._waiter = _current_parent()
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._waiter = None
                self._changed.notify_all()

    def answer_pending(self) -> None:
        """Ask the notebook the prompt the run waits at, if any, and hand the answer over."""
        with self._changed:
            question, self._question = self._question, None
        if question is None:
            return
        try:
            reply: str | BaseException = self._ask(*question)
        except (Exception, KeyboardInterrupt) as error:  # the run's wait acts on it as a cell's would
            reply = error
        with self._changed:
            self._reply = reply
            self._changed.notify_all()

    # --- the run's runner thread --------------------------------------------------------------------

    def can_answer(self) -> bool:
        """Whether a cell waits that can answer; the run's output then goes to that cell, so the
        debugger's answers appear under the prompt they answer."""
        with self._changed:
            waiter = self._waiter
        if waiter is None:
            return False
        if waiter is not self._output_parent:
            self._output_parent = waiter
            _send_thread_output_to(waiter)
        return True

    def ask(self, prompt: str, password: bool) -> str:
        from fsdp2nb.frontend.rank_prompts import PromptDeferred

        with self._changed:
            if self._waiter is None:
                raise PromptDeferred
            self._question, self._reply = (prompt, password), None
            self._changed.notify_all()
            while self._reply is None and self._waiter is not None:
                self._changed.wait()
            reply, self._reply, self._question = self._reply, None, None
        if reply is None:  # the waiting cell ended first (its stop button): the prompt waits on
            raise PromptDeferred
        if isinstance(reply, BaseException):
            raise reply
        return reply


def _current_parent() -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    return shell.get_parent() if shell is not None and hasattr(shell, "get_parent") else {}


def _send_thread_output_to(parent: dict) -> None:
    """Route this thread's output (print, displays) to the cell of `parent` from now on."""
    from IPython import get_ipython

    sys.stdout.flush()
    sys.stderr.flush()
    shell = get_ipython()
    if parent and shell is not None and hasattr(shell, "set_thread_parent"):
        shell.set_thread_parent(parent)
