"""Ranks on the hosts of the Slurm allocation the kernel runs in.

One `srun` step starts the host agent once per node; every agent reads the same launch request
(srun's `--input all` copies the kernel's pipe to each) and takes the ranks of its node by
`SLURM_NODEID`. `--kill-on-bad-exit` ends the whole step when one agent fails, and ending srun
ends every task, as Slurm does for any step.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from fsdp2nb.errors import LaunchError
from fsdp2nb.pool.launcher import AgentExit, AgentProcess, describe_exit_code, write_and_close
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.endpoints import tcp_address
from fsdp2nb.wire.launch_plan import LaunchPlan


class SlurmLaunchError(LaunchError):
    """The step could not be started; one line says why."""


class SrunStep(AgentProcess):
    """The srun process that carries every host's agent: held as a local agent's process is
    (SIGTERM reaches every task through srun), described as a step."""

    def agent_exit(self) -> AgentExit | None:
        code = self.process.poll()
        if code is None:
            return None
        return AgentExit(f"ended, and with it the srun step (srun {describe_exit_code(code)}; srun.log says more)")


class SlurmLauncher:
    def __init__(self, spec: PoolSpec) -> None:
        assert spec.placement is not None and spec.placement.engine == "slurm"
        self.spec = spec
        self._placement = spec.placement
        self.num_nodes = spec.placement.num_nodes
        self.notes: list[str] = []
        self._log_dir = ""

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        self._log_dir = log_dir
        if shutil.which("srun") is None:
            raise SlurmLaunchError("--slurm needs srun on PATH (run the notebook inside salloc or sbatch)")
        return tcp_address(self._placement.listen or cluster_address(), 0)

    def launch(self, plan: LaunchPlan, key: bytes) -> SrunStep:
        command = ["srun", "--nodes", str(self.num_nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                   "--input", "all", sys.executable, "-m", "fsdp2nb.worker.agent"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(os.path.join(self._log_dir, "srun.log"), "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                       start_new_session=True, env=env)
        write_and_close(process, plan.encode(key))
        return SrunStep(process)


def cluster_address() -> str:
    """This host's address on the route to another node of the allocation (no packet is sent)."""
    for node in _allocated_nodes():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((socket.gethostbyname(node), 9))
                host = probe.getsockname()[0]
        except OSError:
            continue
        if not host.startswith("127."):  # that node is this host: try the next
            return host
    raise SlurmLaunchError("cannot tell this host's address on the cluster network from the allocation's "
                           "nodes; give it with --listen ADDRESS")


def _allocated_nodes() -> list[str]:
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:
        raise SlurmLaunchError("cannot read the allocation's nodes (SLURM_JOB_NODELIST, scontrol); "
                               "give this host's cluster address with --listen ADDRESS")
    return names
