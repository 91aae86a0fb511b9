"""input(), getpass and debugger prompts on a rank, answered in the notebook's input box.

A rank has no terminal. `install()` replaces `input`, `getpass.getpass` and `sys.stdin` with
calls that send the prompt to the kernel (`InputRequested`) and block the rank's main thread
until the answer for that prompt comes back (`AnswerInput`, read by the control thread). pdb
and IPython's debugger read their commands through `input()`, so `breakpoint()` works as is.
The stop button's SIGINT ends the wait with KeyboardInterrupt, as for any running cell.
"""

from __future__ import annotations

import builtins
import getpass
import io
import itertools
import queue
import sys
from collections.abc import Callable

from fsdp2nb.errors import InputUnavailable
from fsdp2nb.wire.events import InputRequested
from fsdp2nb.wire.requests import AnswerInput


class InterruptedAtPrompt(BaseException):  # read as what happened, like KeyboardInterrupt
    """The stop button pressed while the rank waited at a prompt. Not a KeyboardInterrupt: pdb's
    command loop answers that with another prompt, where the cell must end as any cell does."""


class NotebookStdin:
    """The rank's line source: each read is one prompt answered in the notebook."""

    def __init__(self, rank: int, send_event: Callable[[InputRequested], object],
                 current_cell_id: Callable[[], int | None], sync_output: Callable[[], None],
                 on_waiting: Callable[[bool], None] | None = None) -> None:
        self._rank = rank
        self._send_event = send_event
        self._current_cell_id = current_cell_id
        self._sync_output = sync_output
        self._on_waiting = on_waiting
        """Told when the main thread starts and stops waiting (a kept pool's activity board)."""
        self._pending: InputRequested | None = None
        """The prompt waiting for its answer, asked again of a kernel that attaches (`ask_again`)."""
        self._prompt_ids = itertools.count(1)
        self._answers: queue.Queue[AnswerInput | None] = queue.Queue()
        self._interrupted_cell_id: int | None = None
        self.waiting = False
        """Whether the main thread waits for an answer (then an interrupt is delivered as one)."""

    def install(self) -> None:
        builtins.input = self.input
        getpass.getpass = self.getpass
        sys.stdin = _PromptedFile(self)

    def input(self, prompt: object = "") -> str:
        return self.ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: object = None) -> str:
        return self.ask(prompt, password=True)

    def ask(self, prompt: str, password: bool) -> str:
        """Send `prompt` to the notebook and return the line typed there (without its newline)."""
        cell_id = self._current_cell_id()
        if cell_id is None:
            raise InputUnavailable(f"rank {self._rank} asked for input outside a cell (a thread of its own), "
                                   "where no input box can answer; ask from the cell's own code")
        prompt_id = next(self._prompt_ids)
        self._sync_output()  # what the rank printed before the prompt (pdb's "> file(line)") comes first
        self.waiting = True
        try:
            if cell_id == self._interrupted_cell_id:  # pdb asks again after an interrupt it caught
                raise InterruptedAtPrompt("the stop button was pressed at the prompt")
            self._pending = InputRequested(rank=self._rank, cell_id=cell_id, prompt_id=prompt_id,
                                           prompt=prompt, password=password)
            self._note_waiting(True)
            self._send_event(self._pending)
            answer = self._next_answer(prompt_id, cell_id)
        finally:
            self.waiting = False
            if self._pending is not None:
                self._pending = None
                self._note_waiting(False)
        if answer.refusal:
            raise InputUnavailable(answer.refusal)
        if answer.eof:
            raise EOFError
        return answer.text

    def _next_answer(self, prompt_id: int, cell_id: int) -> AnswerInput:
        while True:
            answer = self._answers.get()
            if answer is None and self._interrupted_cell_id == cell_id:
                raise InterruptedAtPrompt("the stop button was pressed at the prompt")
            if answer is not None and answer.prompt_id == prompt_id:
                return answer  # else the answer to a prompt that an interrupt abandoned

    def ask_again(self) -> None:
        """Send the waiting prompt again: a kept pool's rank asked it while no kernel held the
        pool, or of a kernel since lost; the kernel that attached asks the user (it ignores a
        prompt it answered already)."""
        pending = self._pending
        if pending is not None:
            self._send_event(pending)

    def _note_waiting(self, waiting: bool) -> None:
        if self._on_waiting is not None:
            self._on_waiting(waiting)

    def deliver(self, answer: AnswerInput) -> None:
        """Called on the control thread with the kernel's answer."""
        self._answers.put(answer)

    def interrupt(self, cell_id: int) -> bool:
        """Called on the control thread when `cell_id` is interrupted; whether the main thread
        waited at a prompt (it then ends the cell; otherwise the caller signals it)."""
        self._interrupted_cell_id = cell_id
        self._answers.put(None)
        return self.waiting


class _PromptedFile(io.TextIOBase):
    """`sys.stdin` for code that reads it directly: each line is asked for in the notebook."""

    def __init__(self, stdin: NotebookStdin) -> None:
        self._stdin = stdin

    @property
    def encoding(self) -> str:
        return "utf-8"

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        """One line: a rank cannot know when the user means to end input (Ctrl-D ends it)."""
        return self.readline()

    def isatty(self) -> bool:
        return False

    def readline(self, size: int | None = -1) -> str:
        try:
            return self._stdin.ask("", password=False) + "\n"
        except EOFError:
            return ""
