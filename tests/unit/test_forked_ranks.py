"""A rank that died is reaped with what it wrote last: appended to its log and in its exit report."""

import os
import subprocess
import sys
import textwrap

# Runs in a process of its own: reaping waits for any child of the process.
_REAP_ONE_DEAD_RANK = textwrap.dedent("""
    import os, sys
    from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
    from fsdp2nb.worker.forked_ranks import ForkedRanks

    rank_plan = RankPlan(rank=1, local_rank=1, device="cpu")
    plan = LaunchPlan(pool_id="t", world_size=2, backend="gloo", ranks=(rank_plan,), address="",
                      runtime_dir=sys.argv[1], log_dir=sys.argv[1], collective_timeout_s=1.0,
                      kernel_pid=os.getppid(), master_port=0)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a rank whose forwarding thread never read its last words
        os.write(write_end, b"last words before dying\\n")
        os._exit(3)
    os.close(write_end)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
    ranks = ForkedRanks(plan)
    ranks.by_pid, ranks.pipes_by_pid = {pid: rank_plan}, {pid: [read_end]}
    [(reaped, status, reaped_plan)] = list(ranks.reap())
    report = ranks.exit_report(reaped_plan.rank, reaped, status)
    print(reaped == pid, ranks.by_pid, ranks.pipes_by_pid, report.rank, report.exit_code, report.signal_name)
    print(report.stderr_tail[-1])
""")


def test_reaping_a_dead_rank_keeps_its_last_output_and_reports_its_exit(tmp_path):
    done = subprocess.run([sys.executable, "-c", _REAP_ONE_DEAD_RANK, str(tmp_path)], capture_output=True,
                          text=True, timeout=30, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True {} {} 1 3 None", "last words before dying"]
    assert (tmp_path / "rank-1.log").read_text() == "last words before dying\n"
