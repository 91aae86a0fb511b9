"""Pool lifecycle through a kernel: bad input changes nothing, no orphans, loopback only, 4 and 8 ranks."""


import psutil
import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel

SHARES_THE_POOL = True  # tests/kernel/conftest.py: no test here restarts, stops or kills the pool

BAD_INPUTS = [
    ("%%fsdp2 --frobnicate\n1", "unrecognized arguments"),
    ("%%fsdp2 --gpus 0\n1", "--gpus"),
    ("%%fsdp2 --gpus -1\n1", "--gpus"),
    ("%%fsdp2 --gpus 64\n1", "--gpus"),
    ("%%fsdp2 --gpus 2\n1", "--cpu N"),
    ("%%fsdp2 --gpus 1 --cpu 2\n1", "exclude each other"),
    ("%%fsdp2 --cpu 2 --ranks 7\n1", "rank 7 does not exist"),
    ("%%fsdp2 --cpu 0\n1", "at least 1"),
    ("%%fsdp2 --cpu 2 --timeout -5\n1", "not usable"),
    ("%%fsdp2 --cpu 2 --timeout inf\n1", "not usable"),
    ("%fsdp2 start --cpu 2 --timeout nan", "not usable"),
    ("%fsdp2 push", "NAME"),
    ("%fsdp2 pull x", "no pool is running"),
    ("%fsdp2 launch", "takes one of"),
]


@pytest.fixture(scope="module")
def bare_kernel():
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    yield k
    k.stop()


@pytest.mark.parametrize(("code", "message"), BAD_INPUTS)
def test_bad_input_gets_one_clear_line_and_starts_nothing(bare_kernel, code, message):
    before = {p.pid for p in psutil.Process(bare_kernel.pid).children(recursive=True)}  # the standby agent
    run = bare_kernel.execute(code)
    assert run.status == "error"
    usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError")]
    assert len(usage) == 1 and message in usage[0], run.stderr
    assert bare_kernel.execute("%fsdp2 status").stdout.strip() == "no pool is running"
    assert {p.pid for p in psutil.Process(bare_kernel.pid).children(recursive=True)} == before


def test_load_ext_twice_and_stop_twice_are_harmless(bare_kernel):
    assert bare_kernel.execute("%load_ext fsdp2nb").status == "ok"
    assert bare_kernel.execute("%fsdp2 stop\n%fsdp2 stop").stdout == "no pool is running\nno pool is running\n"


def _pool_processes(kernel_pid: int) -> list[psutil.Process]:
    return psutil.Process(kernel_pid).children(recursive=True)


def _wait_gone(processes: list[psutil.Process], timeout_s: float = 10) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_four_and_eight_ranks_merge_lines_listen_only_on_loopback_and_end_with_unload():
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        kernel.execute("%load_ext fsdp2nb")
        run = kernel.execute("%%fsdp2 --cpu 4\nprint('hello from', 'even' if rank % 2 == 0 else 'odd')\n"
                             "dist.barrier()\nprint('together')")
        assert run.status == "ok", run.traceback_text
        assert "[0,2] hello from even\n" in run.stdout and "[1,3] hello from odd\n" in run.stdout
        assert "[all] together\n" in run.stdout
        processes = _pool_processes(kernel.pid)
        assert len(processes) == 6  # the host agent, four ranks and the standby agent for a restart
        listening = [c.laddr for p in processes for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert all(addr.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for addr in listening), listening

        assert kernel.execute("%fsdp2 restart --cpu 8", timeout=300).status == "ok"
        # As after a loss is all-reduced: the ranks print together (2 cores run 8 ranks slowly).
        run = kernel.execute("%%fsdp2\ndist.barrier()\nprint('step 1 loss 0.25')\nprint('rank', rank)",
                             timeout=300)
        assert run.status == "ok", run.traceback_text
        lines = run.stdout.splitlines()
        assert lines.count("[all] step 1 loss 0.25") == 1 and len(lines) == 9
        assert {f"[{r}] rank {r}" for r in range(8)} <= set(lines)

        processes = _pool_processes(kernel.pid)
        unload = kernel.execute("%unload_ext fsdp2nb")
        assert unload.status == "ok"
        assert not _wait_gone(processes)
    finally:
        kernel.stop()


RUNNING_POOL_BAD_INPUTS = [(code, message) for code, message in BAD_INPUTS if "no pool is running" not in message]


def _pool_state(kernel: Kernel) -> tuple[list[int], str]:
    """The ranks' pids as the status table shows them, and what `kept` holds on each rank."""
    table = kernel.execute("%fsdp2 status").stdout.splitlines()
    pids = [int(line.split()[1]) for line in table[2:]]
    return pids, kernel.execute("%%fsdp2\nprint(kept)").stdout


def test_bad_input_leaves_a_running_pool_and_its_state_alone(kernel):
    assert kernel.execute("%%fsdp2\nkept = rank + 40").status == "ok"
    before = _pool_state(kernel)
    assert before[1] == "[0] 40\n[1] 41\n" and len(before[0]) == 2
    for code, message in RUNNING_POOL_BAD_INPUTS:
        run = kernel.execute(code)
        usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError")]
        assert run.status == "error" and len(usage) == 1 and message in usage[0], (code, run.stderr)
    assert _pool_state(kernel) == before


def test_status_has_a_row_per_rank_and_help_shows_examples(kernel):
    table = kernel.execute("%fsdp2 status").stdout.splitlines()
    assert table[0].startswith("pool --cpu 2 (ready)")
    assert table[1].split() == ["rank", "pid", "device", "state", "rss", "device", "memory"]
    assert [row.split()[:4:2] for row in table[2:]] == [["0", "cpu"], ["1", "cpu"]]
    for asking in ("%fsdp2?", "%%fsdp2?"):
        pages = kernel.execute(asking).reply["content"]["payload"]
        text = "".join(page["data"]["text/plain"] for page in pages)
        assert "%%fsdp2 --gpus 0,2,3" in text and "%fsdp2 pull loss --all" in text, asking


@pytest.mark.parametrize("how", ["shutdown", "restart"])  # SIGKILL: tests/kernel/test_warm_restart.py
def test_no_worker_survives_the_kernel(how):
    from fsdp2nb.pool import reaper

    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        kernel.execute("%load_ext fsdp2nb")
        assert kernel.execute("%%fsdp2 --cpu 2\nx = 1").status == "ok"
        pool_id = kernel.execute("from fsdp2nb import _session\nprint(_session.pool.pool_id)").stdout.strip()
        processes = _pool_processes(kernel.pid)
        assert len(processes) == 4  # the host agent, two ranks and the standby agent
        if how == "restart":
            kernel.manager.restart_kernel(now=False)
        else:
            kernel.manager.shutdown_kernel(now=False)
        assert not _wait_gone(processes), "pool processes outlived the kernel"
        assert not (reaper.state_dir() / "pools" / f"{pool_id}.json").exists()  # its registry entry went too
    finally:
        if kernel.manager.has_kernel:
            kernel.stop()


def test_collective_timeout_is_settable_at_start(bare_kernel):
    assert bare_kernel.execute("%fsdp2 start --cpu 2 --timeout 3").status == "ok"
    try:
        run = bare_kernel.execute("%%fsdp2 --ranks 0\ndist.barrier()", timeout=120)
        assert run.status == "error"
        assert "[0] rank 0 raised" in run.traceback_text and "imed out" in run.traceback_text
    finally:
        bare_kernel.execute("%fsdp2 stop")


def test_timeout_alone_keeps_the_running_devices(bare_kernel):
    assert bare_kernel.execute("%fsdp2 start --cpu 2").status == "ok"
    try:
        run = bare_kernel.execute("%%fsdp2 --timeout 30\n1")
        assert "asks for --cpu 2 --timeout 30 but the running pool is --cpu 2" in run.stderr
        assert bare_kernel.execute("%fsdp2 restart --timeout 30").status == "ok"
        assert "pool --cpu 2 --timeout 30 (ready)" in bare_kernel.execute("%fsdp2 status").stdout
    finally:
        bare_kernel.execute("%fsdp2 stop")
