"""input(), getpass, breakpoint() and post-mortems on ranks, answered through a real kernel's stdin."""

from __future__ import annotations

import queue
import threading

import pytest

from tests.support.kernel_client import CellRun, Kernel


class StdinAnswers:
    """Answers a cell's input requests from a script per rank (by the `[R]` the prompt starts with),
    recording every request; `interrupt=True` presses the stop button at the first prompt instead."""

    def __init__(self, kernel: Kernel, answers: dict[int, list[str]] | None = None, interrupt: bool = False) -> None:
        self._kernel = kernel
        self._answers = {rank: list(lines) for rank, lines in (answers or {}).items()}
        self._interrupt = interrupt
        self.requests: list[dict] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def run(self, code: str, timeout: float = 120) -> CellRun:
        msg_id = self._kernel.client.execute(code, allow_stdin=True)
        self._thread.start()
        try:
            return self._kernel.collect(msg_id, code, timeout)
        finally:
            self._done.set()
            self._thread.join(5)

    def _serve(self) -> None:
        client = self._kernel.client
        while not self._done.is_set():
            try:
                request = client.get_stdin_msg(timeout=0.2)
            except queue.Empty:
                continue
            content = request["content"]
            self.requests.append(content)
            if self._interrupt:
                self._kernel.manager.interrupt_kernel()
                continue
            rank = int(content["prompt"][1:content["prompt"].index("]")])
            lines = self._answers.get(rank) or ["c"]
            client.input(lines.pop(0))

    @property
    def prompts(self) -> list[str]:
        return [request["prompt"] for request in self.requests]


def test_input_on_a_rank_prompts_in_the_notebook_and_answers_that_rank_only(kernel):
    answers = StdinAnswers(kernel, {0: ["Ada"]})
    run = answers.run("%%fsdp2 --ranks 0\nname = input('your name? ')\nprint('hello', name)")
    assert run.status == "ok", run.traceback_text
    assert answers.prompts == ["[0] your name? "]
    assert run.stdout == "[0] hello Ada\n"


def test_getpass_on_a_rank_asks_for_a_hidden_line(kernel):
    answers = StdinAnswers(kernel, {1: ["s3cret"]})
    run = answers.run("%%fsdp2 --ranks 1\nimport getpass\ntoken = getpass.getpass('token: ')\nprint(len(token))")
    assert run.status == "ok", run.traceback_text
    assert [(r["prompt"], r["password"]) for r in answers.requests] == [("[1] token: ", True)]
    assert run.stdout == "[1] 6\n"


def test_breakpoint_on_every_rank_prompts_one_rank_at_a_time_and_keeps_what_was_changed(kernel):
    answers = StdinAnswers(kernel, {0: ["p x + 100", "!x = 7", "c"], 1: ["c"]})
    run = answers.run("%%fsdp2\nx = rank\nbreakpoint()\nprint('result', x * 10)")
    assert run.status == "ok", run.traceback_text
    first = answers.prompts[0][:3]  # whichever rank asked first keeps the prompt until it continues
    assert answers.prompts in (["[0] (Pdb) "] * 3 + ["[1] (Pdb) "], ["[1] (Pdb) "] + ["[0] (Pdb) "] * 3), first
    assert "[0] 100\n" in run.stdout  # pdb's answer, labelled by rank as other output
    assert "[0] result 70\n" in run.stdout and "[1] result 10\n" in run.stdout, run.stdout


def test_a_rank_in_a_collective_meanwhile_is_shown_with_its_timeout_above_the_prompt(kernel):
    answers = StdinAnswers(kernel, {0: ["c"]})
    code = ("%%fsdp2\nt = torch.ones(1)\nif rank == 0:\n    import time\n    time.sleep(0.5)\n    breakpoint()\n"
            "dist.all_reduce(t)\nprint(int(t.item()))")
    run = answers.run(code)
    assert run.status == "ok", run.traceback_text
    assert answers.prompts == ["[0] (Pdb) "] and run.stdout.endswith("[all] 2\n"), run.stdout
    lines = [m["content"]["data"].get("text/plain", "") for m in run.messages
             if m["msg_type"] in ("display_data", "update_display_data")]
    shown = next((line for line in lines if "waiting for input" in line), "")
    assert "[0] waiting for input" in shown and "[1] in all_reduce at In[" in shown, lines
    assert "times out in about" in shown, shown


def test_quitting_the_debugger_ends_the_cell_as_in_a_plain_cell(kernel, assert_pool_usable):
    answers = StdinAnswers(kernel, {0: ["q"]})
    run = answers.run("%%fsdp2 --ranks 0\nbreakpoint()\nprint('not reached')")
    assert run.status == "error"
    assert "quit the debugger (q)" in run.traceback_text and "not reached" not in run.stdout
    assert_pool_usable()


def test_without_stdin_a_prompt_fails_at_once_in_one_line(kernel, assert_pool_usable):
    msg_id = kernel.client.execute("%%fsdp2\nanswer = input('go? ')", allow_stdin=False)
    run = kernel.collect(msg_id, timeout=60)
    assert run.status == "error"
    text = run.traceback_text
    assert "this frontend cannot answer input" in text, text
    assert "bdb.py" not in text and "EOFError" not in text
    assert_pool_usable()


def test_the_stop_button_at_a_prompt_ends_the_cell_on_every_rank(kernel, assert_pool_usable):
    answers = StdinAnswers(kernel, interrupt=True)
    run = answers.run("%%fsdp2\nbreakpoint()\nimport time\ntime.sleep(30)\nprint('not reached')", timeout=60)
    assert run.status == "error"
    assert answers.prompts and run.error["ename"] == "RankError"
    assert "KeyboardInterrupt" in run.traceback_text and "not reached" not in run.stdout
    assert "bdb.py" not in run.traceback_text and "stdin.py" not in run.traceback_text
    assert "the pool was restarted" not in run.traceback_text  # ended as asked, no state lost
    assert_pool_usable()


def test_post_mortem_opens_the_failing_frame_of_the_rank_that_failed_first(kernel):
    failed = kernel.execute("%%fsdp2\ndef scaled(v):\n    z = v * 2\n    raise ValueError(z)\n"
                            "if rank == 1:\n    scaled(21)")
    assert failed.status == "error"
    answers = StdinAnswers(kernel, {1: ["p z", "up", "p rank * 1000", "q"]})
    run = answers.run("%fsdp2 debug")
    assert run.status == "ok", run.traceback_text
    assert answers.prompts == ["[1] ipdb> "] * 4
    assert "[1] 42\n" in run.stdout and "[1] 1000\n" in run.stdout, run.stdout


def test_debug_names_a_rank_that_does_not_exist(kernel):
    run = kernel.execute("%fsdp2 debug --rank 5")
    usage = [text for text in run.stderr.splitlines() if text.startswith("UsageError: ")]
    assert run.status == "error" and len(usage) == 1 and "--rank 5 is not a rank of this pool" in usage[0]


def test_a_background_run_at_a_breakpoint_fails_with_one_line(kernel, assert_pool_usable):
    started = kernel.execute("%%fsdp2 --bg --name paused\nbreakpoint()\nprint('not reached')")
    assert started.status == "ok", started.traceback_text
    waited = kernel.execute("%fsdp2 wait paused", timeout=60)
    assert waited.status == "error"
    assert "background (--bg)" in waited.traceback_text and "without --bg" in waited.traceback_text
    assert_pool_usable()


@pytest.fixture(autouse=True)
def _no_stdin_left(kernel):
    """A prompt left unanswered would hang every later test: none may be."""
    yield
    with pytest.raises(queue.Empty):
        kernel.client.get_stdin_msg(timeout=0.1)
