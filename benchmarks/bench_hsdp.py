"""HSDP (2 hosts x 2 ranks, a 2 x 2 mesh) against flat FSDP (4 ranks) over a slow link between hosts.

The hosts are two network namespaces joined by a veth pair (tests/support/netns.py, root only);
one kernel on host 0 starts a pool of 2 CPU ranks on each through a stand-in srun (`--slurm`).
Each veth end gets a token bucket (`tc qdisc ... tbf rate 1gbit`), so traffic between the hosts
crosses at 1 Gbit/s while ranks of one host talk over loopback. On the same ranks, one model is
sharded flat over all 4 and a copy over `fsdp2nb.hsdp_mesh()`; their steps alternate, each timed
between barriers. The model is wide and shallow in compute (8 Llama blocks of width 512, fp32,
1 x 8 tokens per rank), so the all-gathers (every block's, in forward and again in backward)
and the gradient reduce-scatter dominate a flat step; HSDP keeps those inside a host and sends
one all-reduce of the gradient shards across. Then the same without the limit, and on one host
(`--cpu 4`, `hsdp_mesh(replicate=2)`), where HSDP should cost nothing over flat FSDP.

Each pool is measured with plain steps and with steps that accumulate gradients over 4
micro-batches (`set_requires_gradient_sync(False)` until the last): every micro-batch all-gathers
every block twice, but gradients are reduced once per step, so the all-gathers dominate more.
Reported per pool and number of micro-batches: the median step time of each mesh, their ratio,
the link's measured rate and the load average.
Run: .venv/bin/python -m benchmarks.bench_hsdp [--steps 6] [--micro-batches 1,4] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from tests.support.fake_srun import write_srun
from tests.support.kernel_client import WITHOUT_GPUS, Kernel
from tests.support.netns import TestHost, TestHosts

MODEL_CELL = """%%fsdp2
import json, statistics, time
import fsdp2nb
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=8, vocab_size=2048, max_position_embeddings=64)

def sharded(mesh):
    torch.manual_seed(0)  # the same weights on every rank and for both meshes
    model = LlamaForCausalLM(config)
    fsdp2nb.FSDP2Engine(mixed_precision="fp32", mesh=mesh).shard_model(model)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)

runs = {"flat": sharded(mesh), "hsdp": sharded(fsdp2nb.hsdp_mesh(REPLICATE))}
ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(rank))

def timed_step(model, optimizer, num_micro):
    dist.barrier()
    started = time.perf_counter()
    for micro in range(num_micro):  # gradients reduced after the last micro-batch only
        model.set_requires_gradient_sync(micro == num_micro - 1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    fsdp2nb.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return time.perf_counter() - started

if rank == 0:
    print("params", sum(p.numel() for p in runs["flat"][0].parameters()))
"""
STEPS_CELL = """%%fsdp2
times = {name: [] for name in runs}
for i in range(WARMUP + STEPS):
    for name, (model, optimizer) in (runs.items() if i % 2 else reversed(runs.items())):
        elapsed = timed_step(model, optimizer, MICRO)
        if i >= WARMUP:
            times[name].append(elapsed)
if rank == 0:
    print("TIMES " + json.dumps(times))
"""
WARMUP = 2

# Sends SIZE bytes to (argv[1], argv[2]) and prints the seconds it took; the receiver reads them all.
_SINK = ("import socket,sys\ns=socket.create_server((sys.argv[1],0))\nprint(s.getsockname()[1],flush=True)\n"
         "c,_=s.accept()\nn=0\nwhile True:\n    b=c.recv(1<<20)\n    if not b: break\n    n+=len(b)\nprint(n)")
_SOURCE = ("import socket,sys,time\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])))\nb=bytes(1<<20)\n"
           "t=time.perf_counter()\nfor _ in range(int(sys.argv[3])): c.sendall(b)\nc.shutdown(socket.SHUT_WR)\n"
           "c.recv(1)\nprint(time.perf_counter()-t)")


def limit_link(hosts: TestHosts, rate: str | None) -> None:
    """A token bucket of `rate` on both ends of the veth pair (None: take it off)."""
    for host in hosts:
        if rate is None:
            host.run(["tc", "qdisc", "del", "dev", host.interface, "root"], capture_output=True)
        else:
            host.run(["tc", "qdisc", "replace", "dev", host.interface, "root", "tbf", "rate", rate,
                      "burst", "256kb", "latency", "50ms"], check=True)


def link_mb_per_s(sender: TestHost, receiver: TestHost, megabytes: int = 64) -> float:
    """What one TCP stream carries from `sender` to `receiver`, in MB/s."""
    sink = receiver.popen([sys.executable, "-c", _SINK, receiver.address], stdout=subprocess.PIPE, text=True)
    port = sink.stdout.readline().strip()
    out = sender.run([sys.executable, "-c", _SOURCE, receiver.address, port, str(megabytes)],
                     capture_output=True, text=True, check=True, timeout=120)
    sink.wait(timeout=30)
    return megabytes * 2**20 / 1e6 / float(out.stdout)


def measure(kernel: Kernel, steps: int, num_micro: int) -> dict[str, float]:
    """Median seconds per step of each mesh, steps alternating between them."""
    cell = STEPS_CELL.replace("WARMUP", str(WARMUP)).replace("STEPS", str(steps)).replace("MICRO", str(num_micro))
    run = kernel.execute(cell, timeout=3600)
    assert run.status == "ok", run.traceback_text + run.stderr
    times = json.loads(re.search(r"TIMES (.*)", run.stdout).group(1))
    return {name: statistics.median(values) for name, values in times.items()}


def start_pool(kernel: Kernel, options: str, replicate: str) -> None:
    kernel.execute("%fsdp2 stop")
    run = kernel.execute(f"%fsdp2 start {options} --no-dashboard", timeout=600)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute(MODEL_CELL.replace("REPLICATE", replicate), timeout=900)
    assert run.status == "ok", run.traceback_text + run.stderr


def report(kernel: Kernel, pool: str, link: str, args: argparse.Namespace) -> None:
    """One row per number of micro-batches a step accumulates."""
    for num_micro in args.micro_batches:
        medians = measure(kernel, args.steps, num_micro)
        flat, hsdp = medians["flat"], medians["hsdp"]
        print(f"{pool:32} {num_micro:5} {flat:8.2f} s {hsdp:8.2f} s {flat / hsdp:8.2f}x   {link}"
              f"   (load {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each mesh per row")
    parser.add_argument("--micro-batches", type=lambda text: [int(n) for n in text.split(",")], default=[1, 4],
                        help="micro-batches per step, one row each (comma-separated; default 1,4)")
    parser.add_argument("--rate", default="1gbit", help="the link's limit between the hosts (tc tbf rate)")
    parser.add_argument("--mtu", type=int, default=1500, help="the veth pair's MTU (set before the pool connects)")
    parser.add_argument("--no-one-host", action="store_true", help="leave out the one-host pool")
    parser.add_argument("--no-unlimited", action="store_true", help="leave out the two hosts without a limit")
    args = parser.parse_args()
    reason = TestHosts.unavailable_reason()
    if reason:
        print(f"bench_hsdp skipped: it needs network namespaces ({reason})")
        return
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'pool':32} {'micro':>5} {'flat (4)':>10} {'HSDP 2x2':>10} {'flat/HSDP':>9}   link")
    with TestHosts(2) as hosts, tempfile.TemporaryDirectory() as bin_dir:
        write_srun(bin_dir, hosts.names)
        for host in hosts:
            host.run(["ip", "link", "set", "dev", host.interface, "mtu", str(args.mtu)], check=True)
        env = {**WITHOUT_GPUS, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "1",
               "SLURM_JOB_NUM_NODES": "2"}
        kernel = Kernel(env=env, argv_prefix=hosts[0].exec_prefix())
        try:
            assert kernel.execute("%load_ext fsdp2nb").status == "ok"
            start_pool(kernel, f"--slurm --cpu-per-node 2 --listen {hosts[0].address}", "")
            limit_link(hosts, args.rate)
            rate = link_mb_per_s(hosts[0], hosts[1])
            report(kernel, f"2 hosts x 2 ranks, link {args.rate}", f"{rate:.0f} MB/s", args)
            if not args.no_unlimited:
                limit_link(hosts, None)
                rate = link_mb_per_s(hosts[0], hosts[1])
                report(kernel, "2 hosts x 2 ranks, no limit", f"{rate:.0f} MB/s", args)
            if not args.no_one_host:
                start_pool(kernel, "--cpu 4", "replicate=2")
                report(kernel, "1 host x 4 ranks (replicate=2)", "loopback", args)
        finally:
            kernel.stop()
            limit_link(hosts, None)


if __name__ == "__main__":
    main()
