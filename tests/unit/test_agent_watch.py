"""The host agent returns once its last rank has been reaped, without waiting for another signal."""

import os
import subprocess
import sys
import textwrap

# Runs in a process of its own: the agent's wake-ups use the main thread's signal wakeup fd.
_WATCH_ONE_EXITED_RANK = textwrap.dedent("""
    import os, sys
    from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
    from fsdp2nb.worker.agent import Agent

    class Events:
        def send_event(self, message):
            print("reported", type(message).__name__, message.exit_code, flush=True)

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, its SIGCHLD already delivered; not reaped
    rank_plan = RankPlan(rank=0, local_rank=0, device="cpu")
    plan = LaunchPlan(pool_id="t", world_size=1, backend="gloo", ranks=(rank_plan,), address="",
                      runtime_dir=sys.argv[1], log_dir=sys.argv[1], collective_timeout_s=1.0,
                      kernel_pid=os.getppid(), master_port=0)
    agent = Agent(plan, b"k")
    agent.ranks.by_pid, agent.ranks.pipes_by_pid, agent.channels = {pid: rank_plan}, {pid: []}, Events()
    agent._watch()
    print("watch returned", flush=True)
""")


def test_watch_returns_after_reaping_the_last_rank(tmp_path):
    # Before the fix the agent reaped the rank, then slept until some other signal came: a pool's
    # stop waited out its 30 s grace and the next start reported the agent as orphaned.
    done = subprocess.run([sys.executable, "-c", _WATCH_ONE_EXITED_RANK, str(tmp_path)], capture_output=True,
                          text=True, timeout=30, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["reported RankExited 0", "watch returned"]
