"""A pool across two hosts against the same pool on one host, measured side by side in one run.

The hosts are network namespaces joined by a veth pair (tests/support/netns.py, root only);
one kernel runs on host 0 and alternates between the two pools:
- two hosts x 1 CPU rank, through a real Ray cluster (`--ray`) and through a stand-in srun
  (`--slurm`): ranks reach the kernel over TCP with TLS and meet through rank 0's TCPStore;
- one host x 2 CPU ranks (`--cpu 2`): Unix sockets and a FileStore.
Reported: the added cost of an empty `%%fsdp2` cell (median of paired differences against a
plain cell) and the cold start (`%fsdp2 start` until every rank has joined), with their ratios.
Run: .venv/bin/python -m benchmarks.bench_hosts [--runs 100] [--starts 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from benchmarks.bench_pool import cell_ms, paired_cell_ms
from tests.support.fake_srun import write_srun
from tests.support.kernel_client import WITHOUT_GPUS, Kernel
from tests.support.netns import TestHosts


def started_in_s(kernel: Kernel, options: str) -> float:
    kernel.execute("%fsdp2 stop")
    started = time.perf_counter()
    run = kernel.execute(f"%fsdp2 start {options} --no-dashboard", timeout=600)
    assert run.status == "ok", run.traceback_text + run.stderr
    return time.perf_counter() - started


def measure(kernel: Kernel, pools: dict[str, str], runs: int, starts: int) -> dict[str, tuple[float, float]]:
    """Per pool: (median cold start in s, median added empty-cell cost in ms); pools take turns."""
    cold: dict[str, list[float]] = {name: [] for name in pools}
    added: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(starts):
        for name, options in pools.items():
            cold[name].append(started_in_s(kernel, options))
            cell_ms(kernel, "%%fsdp2\npass")  # the first cell warms the path
            added[name].append(paired_cell_ms(kernel, runs)[2])
    return {name: (statistics.median(cold[name]), statistics.median(added[name])) for name in pools}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="paired empty cells per start")
    parser.add_argument("--starts", type=int, default=3, help="cold starts per pool")
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray pool")
    args = parser.parse_args()
    reason = TestHosts.unavailable_reason()
    if reason:
        print(f"bench_hosts skipped: it needs network namespaces ({reason})")
        return
    with TestHosts(2) as hosts, tempfile.TemporaryDirectory() as bin_dir:
        write_srun(bin_dir, hosts.names)
        env = {**WITHOUT_GPUS, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "1",
               "SLURM_JOB_NUM_NODES": "2"}
        pools = {"one host x 2 ranks": "--cpu 2",
                 "2 hosts x 1 rank (srun)": f"--slurm --cpu-per-node 1 --listen {hosts[0].address}"}
        cluster = None
        if not args.no_ray:
            from tests.support.ray_cluster import RayCluster

            cluster = RayCluster(hosts, python=sys.executable)
            cluster.wait_until_nodes(2)
            env = {**cluster.driver_env(), **env}  # the driver's RAY_TMPDIR, and this PATH with srun
            pools["2 hosts x 1 rank (Ray)"] = f"--ray {cluster.address} --nodes 2 --cpu-per-node 1"
        kernel = Kernel(env=env, argv_prefix=hosts[0].exec_prefix())
        try:
            assert kernel.execute("%load_ext fsdp2nb").status == "ok"
            results = measure(kernel, pools, args.runs, args.starts)
        finally:
            kernel.stop()
            if cluster is not None:
                cluster.stop()
    base_start, base_cell = results["one host x 2 ranks"]
    print(f"{'pool':28} {'cold start':>12} {'ratio':>7} {'empty cell added':>18} {'ratio':>7}")
    for name, (start_s, cell) in results.items():
        print(f"{name:28} {start_s:10.2f} s {start_s / base_start:6.2f}x {cell:15.2f} ms {cell / base_cell:6.2f}x")


if __name__ == "__main__":
    main()
