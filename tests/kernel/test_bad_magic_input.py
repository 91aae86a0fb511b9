"""Bad input to every `%fsdp2` command and to the `%%fsdp2` cell magic, through a real kernel:
each is refused as IPython's UsageError in one line that says what was wrong, and none of them
starts a pool (nothing changed). The table must name every command the parser knows."""

from __future__ import annotations

import pytest

from fsdp2nb.frontend.magic_options import COMMANDS
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

BAD_LINES: dict[str, tuple[str, str]] = {
    # command: (the magic as typed, a word the one-line refusal contains)
    "start": ("%fsdp2 start --cpu 0", "0"),
    "stop": ("%fsdp2 stop --now", "--now"),
    "restart": ("%fsdp2 restart --cpu -2", "-2"),
    "status": ("%fsdp2 status everything", "everything"),
    "push": ("%fsdp2 push not_defined_anywhere", "no pool is running"),
    "pull": ("%fsdp2 pull x --rank one", "one"),
    "save": ("%fsdp2 save -1", "-1"),
    "load": ("%fsdp2 load latest extra", "extra"),
    "dashboard": ("%fsdp2 dashboard --wide", "--wide"),
    "metrics": ("%fsdp2 metrics --as-csv", "--as-csv"),
    "wait": ("%fsdp2 wait no_such_run", "no_such_run"),
    "interrupt": ("%fsdp2 interrupt no_such_run", "no_such_run"),
    "runs": ("%fsdp2 runs --all", "--all"),
    "debug": ("%fsdp2 debug --rank two", "two"),
    "pools": ("%fsdp2 pools --all-users", "--all-users"),
    "attach": ("%fsdp2 attach no-such-pool", "no-such-pool"),
    "detach": ("%fsdp2 detach", "detach"),
    "plan": ("%fsdp2 plan /no/such/model --cpu 2", "/no/such/model"),
    "profile": ("%fsdp2 profile --steps zero", "zero"),
    "stacks": ("%fsdp2 stacks --rank two", "two"),
}
BAD_OTHERS: dict[str, tuple[str, str]] = {
    "no command": ("%fsdp2 bogus", "bogus"),
    "cell, no ranks": ("%%fsdp2 --cpu 0\npass", "0"),
    "cell, ranks not numbers": ("%%fsdp2 --cpu 2 --ranks first\npass", "first"),
    "cell, timeout": ("%%fsdp2 --cpu 2 --timeout -5\npass", "-5"),
    "cell, name without --bg": ("%%fsdp2 --name run1\npass", "--bg"),
}


@pytest.fixture(scope="module")
def kernel():
    kernel = Kernel(env=WITHOUT_GPUS)
    assert kernel.execute("%load_ext fsdp2nb").status == "ok"
    yield kernel
    kernel.stop()


def test_the_table_names_every_command():
    assert set(BAD_LINES) == set(COMMANDS)


@pytest.mark.parametrize("case", [*BAD_LINES, *BAD_OTHERS])
def test_bad_input_is_one_usage_error_line(kernel, case):
    line, word = {**BAD_LINES, **BAD_OTHERS}[case]
    run = kernel.execute(line)
    assert run.status == "error", (line, run.stdout)
    error = run.reply["content"]
    assert error["ename"] == "UsageError", (line, error["ename"], error["evalue"])
    assert error["evalue"].strip() and "\n" not in error["evalue"].strip(), (line, error["evalue"])
    assert word in error["evalue"], (line, error["evalue"])


def test_none_of_the_refusals_started_a_pool(kernel):
    for line, _ in [*BAD_LINES.values(), *BAD_OTHERS.values()]:
        kernel.execute(line)
    run = kernel.execute("import fsdp2nb\nprint(fsdp2nb._session.pool is None)")
    assert run.stdout.strip() == "True", run.stdout + run.traceback_text
