"""The ranks' prompts for input during a request's wait: a rank's input(), getpass or debugger
prompt is asked of the notebook on the waiting thread, one at a time: the rank being debugged
first, then in rank order. Before a rank's first prompt, the line above it says where the other
running ranks are (a collective, say), since the prompt blocks the thread that would show it.

`RequestWait` (frontend/request_wait.py) holds one `RankPrompts` and hands it the prompts its
ranks send; how the notebook is asked (`AskInput`) is frontend/notebook_input.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp2nb.errors import Fsdp2nbError
from fsdp2nb.frontend.output import StreamMerger, rank_label, write_to_kernel
from fsdp2nb.wire.events import EventMessage, InputRequested, RankActivity
from fsdp2nb.wire.requests import AnswerInput, ReportActivity

if TYPE_CHECKING:
    from fsdp2nb.frontend.cell_progress import CellProgress
    from fsdp2nb.pool.handle import PoolHandle

PROMPT_FOCUS_S = 0.5
"""After answering a rank's prompt, how long its next prompt is waited for before another rank's
is shown: a debugger session on one rank is not cut by the prompts of the others."""
ACTIVITY_BEFORE_PROMPT_S = 0.03
"""Before a prompt, how long the other running ranks may take to say where they are (a rank in a
collective meanwhile is shown with the time left of its timeout above the prompt)."""

AskInput = Callable[[str, bool], str]
"""Asks the notebook for a line: (prompt, password) -> the line; raises KeyboardInterrupt when the
stop button is pressed meanwhile, EOFError at end of input, PromptDeferred when the prompt should
wait for a later moment, another error where none can answer."""


class PromptDeferred(Fsdp2nbError):  # what happened, not a failure
    """No one can answer the prompt now; it stays pending and is asked again later."""


class RankPrompts:
    """The prompts of one request's ranks (`progress.prompts`, rank -> the prompt it waits at),
    answered on the waiting thread. What else the wait does is reached through the callables it
    gives: `handle` (an event that came meanwhile), `note_activity` (where a rank is),
    `show_waiting_line` (at once) and `stop_pressed` (the stop button at a prompt)."""

    def __init__(self, progress: CellProgress, pool: PoolHandle, cell_ids: dict[int, int], merger: StreamMerger, *,
                 ask_input: AskInput, before_prompt: Callable[[], bool] | None,
                 handle: Callable[[EventMessage], None], note_activity: Callable[[RankActivity], None],
                 show_waiting_line: Callable[[], None], stop_pressed: Callable[[], None]) -> None:
        """`before_prompt` is called before a prompt is shown; False: no one can answer yet, it waits."""
        self._progress = progress
        self._pool = pool
        self._cell_ids = cell_ids
        self._merger = merger
        self._ask_input = ask_input
        self._before_prompt = before_prompt
        self._handle = handle
        self._note_activity = note_activity
        self._show_waiting_line = show_waiting_line
        self._stop_pressed = stop_pressed
        self._prompting_rank: int | None = None
        """The rank whose prompt was answered last, and when (see PROMPT_FOCUS_S)."""
        self._answered_at = 0.0
        self._answered: set[tuple[int, int]] = set()
        """(rank, prompt id) of prompts answered: a kept pool's rank asks again on attach."""

    def add(self, prompt: InputRequested) -> None:
        """A rank waits at `prompt` (unless it was answered already)."""
        if (prompt.rank, prompt.prompt_id) not in self._answered:
            self._progress.prompts[prompt.rank] = prompt

    def answer_due(self) -> None:
        """Ask one waiting prompt, if one is due and someone can answer it."""
        if (self._progress.prompts and self._may_prompt_now()
                and (self._before_prompt is None or self._before_prompt())):
            self._answer_prompt()

    def _may_prompt_now(self) -> bool:
        """Whether to show a prompt now: the rank being debugged asks again, or has had its moment."""
        progress = self._progress
        focus = self._prompting_rank
        return (focus is None or focus in progress.prompts or focus in progress.finished
                or time.monotonic() - self._answered_at > PROMPT_FOCUS_S)

    def _answer_prompt(self) -> None:
        """Ask the notebook for a waiting rank's line (the rank being debugged first, then in rank
        order) and send it to that rank only."""
        progress = self._progress
        focus = self._prompting_rank
        prompt = progress.prompts[focus if focus in progress.prompts else min(progress.prompts)]
        if prompt.rank != focus:  # a new rank's session: say where the others are, once
            self._ask_others_where_they_are(prompt.rank)
        self._prompting_rank = prompt.rank
        self._merger.flush()  # what the rank printed before its prompt (pdb's "> file(line)") first
        self._say_who_waits(prompt.rank)
        del progress.prompts[prompt.rank]
        label = rank_label([prompt.rank], self._pool.world_size) or "[0]"
        if progress.interrupted_at is not None:  # asked again after the interrupt: the cell is ending
            self._send_answer(prompt, AnswerInput(cell_id=prompt.cell_id, prompt_id=prompt.prompt_id,
                                                  refusal="the cell was interrupted"))
            return
        try:
            text = self._ask_input(f"{label} {prompt.prompt}", prompt.password)
            answer = AnswerInput(cell_id=prompt.cell_id, prompt_id=prompt.prompt_id, text=text)
        except PromptDeferred:
            progress.prompts.setdefault(prompt.rank, prompt)
            return
        except KeyboardInterrupt:  # the stop button at the prompt: as for any running cell
            progress.prompts.clear()
            self._stop_pressed()
            return
        except EOFError:
            answer = AnswerInput(cell_id=prompt.cell_id, prompt_id=prompt.prompt_id, eof=True)
        except Exception as error:  # no frontend can answer (nbclient, a background run)
            answer = AnswerInput(cell_id=prompt.cell_id, prompt_id=prompt.prompt_id,
                                 refusal=_refusal(prompt, error))
        self._answered.add((prompt.rank, prompt.prompt_id))
        progress.last_output_at = self._answered_at = time.monotonic()  # a prompt is not time gone quiet
        self._send_answer(prompt, answer)

    def _send_answer(self, prompt: InputRequested, answer: AnswerInput) -> None:
        try:
            self._pool.send(prompt.rank, answer, connect_timeout_s=0)
        except ConnectionError:
            pass  # its end is reported as an exit of its own

    def _ask_others_where_they_are(self, prompting: int) -> None:
        """The kernel's thread blocks at the prompt: first learn where the other running ranks
        are (briefly), so the waiting line above the prompt shows them, e.g. in a collective."""
        progress = self._progress
        others = {rank for rank in progress.running if rank != prompting and rank not in progress.prompts}
        for rank in others:
            try:
                self._pool.send(rank, ReportActivity(cell_id=self._cell_ids[rank]), connect_timeout_s=0)
            except ConnectionError:
                pass
        deadline = time.monotonic() + ACTIVITY_BEFORE_PROMPT_S
        while others and time.monotonic() < deadline:
            event = self._pool.next_event(0.005)
            if event is None:
                continue
            if isinstance(event, RankActivity):
                others.discard(event.rank)
                self._note_activity(event)
            else:
                self._handle(event)
        progress.activity_asked_at = time.monotonic()

    def _say_who_waits(self, answering: int) -> None:
        """Before a prompt where other ranks still run: which ranks wait for input, and where the
        others are (the waiting line, shown at once: the prompt blocks this thread)."""
        progress = self._progress
        waiting = sorted(progress.prompts)
        if len(waiting) > 1:
            write_to_kernel("stderr", f"ranks {', '.join(map(str, waiting))} wait for input; "
                                      f"answering rank {answering} first\n")
        if len(progress.running) > 1:
            self._show_waiting_line()


def _refusal(prompt: InputRequested, error: Exception) -> str:
    """One line for the rank's error when no one can answer its prompt."""
    from IPython.core.error import StdinNotImplementedError

    asked = f"rank {prompt.rank} asked for input at the prompt {prompt.prompt.strip()!r}"
    if isinstance(error, StdinNotImplementedError):
        return (f"{asked}, but this frontend cannot answer input (it runs cells without stdin, as nbclient "
                "does); run the notebook in JupyterLab or Notebook to use input() or pdb on ranks")
    return f"{asked}, but {error}"
