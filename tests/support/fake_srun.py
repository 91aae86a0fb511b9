"""A stand-in for Slurm's `srun` that starts one task per test host (network namespace).

    FSDP2NB_FAKE_SLURM_HOSTS=ns0,ns1 python tests/support/fake_srun.py \\
        --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 --input all CMD ARG...

Task (node i, local task j) runs CMD inside namespace i with SLURM_NODEID=i, SLURM_PROCID,
SLURM_LOCALID=j, SLURM_NNODES, SLURM_NTASKS, SLURM_JOB_ID (the caller's, else a fake one) and
SLURMD_NODENAME (the namespace's name), each in a session of its own. As srun does:
- `--input all` copies this process's stdin to every task's stdin (the default: only task 0's);
- `--kill-on-bad-exit=1` ends every task as soon as one exits non-zero;
- SIGTERM or SIGINT is passed on as SIGTERM to every task, SIGKILL following after 3 s;
- the exit status is the first non-zero task status (128 + signal for a task killed by one), else 0.
Task output goes straight to this process's stdout and stderr.

`write_srun(directory, hosts)` writes an executable `srun` that runs this file by its path (it
imports only the standard library, so any working directory will do), for a test to put first
on PATH.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

HOSTS_ENV = "FSDP2NB_FAKE_SLURM_HOSTS"
"""Comma-separated network namespace names, node 0 first."""
KILL_AFTER_S = 3.0
"""Seconds between the SIGTERM to the tasks and the SIGKILL, as srun's default KillWait."""
_CHUNK = 65536


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="srun", description="fsdp2nb's stand-in for Slurm's srun")
    parser.add_argument("-N", "--nodes", type=int, required=True)
    parser.add_argument("--ntasks-per-node", type=int, default=1)
    parser.add_argument("-K", "--kill-on-bad-exit", type=int, nargs="?", const=1, default=0)
    parser.add_argument("-i", "--input", default="0", help="'all' or a task number (only 'all' and 0)")
    parser.add_argument("-J", "--job-name", default=None, help="accepted and ignored")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command to run")
    if args.nodes < 1 or args.ntasks_per_node < 1:
        parser.error(f"--nodes={args.nodes} and --ntasks-per-node={args.ntasks_per_node} must be at least 1")
    if args.input not in ("all", "0"):
        parser.error(f"--input={args.input!r}: only 'all' and '0' are supported")
    return args


def task_env(*, node: int, local: int, num_nodes: int, tasks_per_node: int, hosts: Sequence[str],
             job_id: str) -> dict[str, str]:
    """The environment of task `local` on node `node`: the caller's plus Slurm's task variables."""
    return dict(
        os.environ,
        SLURM_NODEID=str(node),
        SLURM_PROCID=str(node * tasks_per_node + local),
        SLURM_LOCALID=str(local),
        SLURM_NNODES=str(num_nodes),
        SLURM_NTASKS=str(num_nodes * tasks_per_node),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_JOB_ID=job_id,
        SLURM_JOBID=job_id,
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST=",".join(hosts[:num_nodes]),
        SLURMD_NODENAME=hosts[node],
    )


class Step:
    """The running tasks of one fake job step."""

    def __init__(self, args: argparse.Namespace, hosts: Sequence[str]) -> None:
        job_id = os.environ.get("SLURM_JOB_ID") or f"9{os.getpid()}"
        self.tasks: list[subprocess.Popen] = []
        for node in range(args.nodes):
            for local in range(args.ntasks_per_node):
                env = task_env(node=node, local=local, num_nodes=args.nodes,
                               tasks_per_node=args.ntasks_per_node, hosts=hosts, job_id=job_id)
                self.tasks.append(subprocess.Popen(
                    ["ip", "netns", "exec", hosts[node], *args.command], env=env,
                    stdin=subprocess.PIPE, start_new_session=True,
                ))
        fed = self.tasks if args.input == "all" else self.tasks[:1]
        for task in self.tasks:
            if task not in fed:
                task.stdin.close()
        self._ending = threading.Event()
        threading.Thread(target=self._copy_stdin, args=(fed,), daemon=True, name="srun-stdin").start()

    def _copy_stdin(self, fed: list[subprocess.Popen]) -> None:
        """Copy our stdin to each fed task's stdin until EOF; a task that has closed its stdin is skipped."""
        open_pipes = [task.stdin for task in fed]
        while open_pipes:
            try:
                chunk = os.read(0, _CHUNK)
            except OSError:  # no stdin at all
                chunk = b""
            for pipe in list(open_pipes):
                try:
                    if chunk:
                        pipe.write(chunk)
                        pipe.flush()
                    else:
                        pipe.close()
                except (BrokenPipeError, OSError, ValueError):
                    open_pipes.remove(pipe)
                    continue
                if not chunk:
                    open_pipes.remove(pipe)

    def end(self) -> None:
        """SIGTERM every running task's process group, then SIGKILL after KILL_AFTER_S. Idempotent."""
        if self._ending.is_set():
            return
        self._ending.set()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + KILL_AFTER_S
        while any(t.poll() is None for t in self.tasks) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)

    def kill_leftovers(self) -> None:
        """SIGKILL what the ended tasks left in their process groups, as Slurm ends a step's processes."""
        self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: signal.Signals) -> None:
        for task in self.tasks:
            try:
                os.killpg(task.pid, sig)  # each task leads its own session and process group
            except ProcessLookupError:
                pass

    def wait(self, kill_on_bad_exit: bool) -> int:
        """Wait for every task; return the first non-zero status (128 + signal when killed), else 0."""
        first_bad = 0
        pending = list(self.tasks)
        while pending:
            for task in list(pending):
                code = task.poll()
                if code is None:
                    continue
                pending.remove(task)
                if code != 0 and first_bad == 0:
                    first_bad = code if code > 0 else 128 - code
                    if kill_on_bad_exit:
                        threading.Thread(target=self.end, daemon=True, name="srun-end").start()
            time.sleep(0.05)
        return first_bad


def hosts_from_env() -> list[str]:
    value = os.environ.get(HOSTS_ENV, "")
    return [name for name in value.split(",") if name]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    hosts = hosts_from_env()
    if args.nodes > len(hosts):
        print(f"srun: error: --nodes={args.nodes} but {HOSTS_ENV} names {len(hosts)} host(s): {hosts}",
              file=sys.stderr)
        return 1
    step = Step(args, hosts)

    def on_signal(signum: int, _frame: object) -> None:
        threading.Thread(target=step.end, daemon=True, name="srun-end").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = step.wait(kill_on_bad_exit=bool(args.kill_on_bad_exit))
    step.kill_leftovers()
    return code


def write_srun(directory: str | os.PathLike, hosts: Sequence[str] | None = None, *,
               python: str = sys.executable) -> Path:
    """Write an executable `srun` into `directory` that runs this module; return its path.

    With `hosts`, the script sets FSDP2NB_FAKE_SLURM_HOSTS itself; without, the caller's
    environment must. Put `directory` first on PATH to make it the `srun` a launcher finds.
    """
    path = Path(directory) / "srun"
    lines = ["#!/bin/sh"]
    if hosts is not None:
        lines.append(f"{HOSTS_ENV}={shlex.quote(','.join(hosts))}; export {HOSTS_ENV}")
    lines.append(f'exec {shlex.quote(python)} {shlex.quote(str(Path(__file__).resolve()))} "$@"')
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    sys.exit(main())
