"""Why a rank's sampler thread never reads a parameter's `.grad` (fsdp2nb.worker.sampler.TrackedSizes).

Two gloo ranks train a small FSDP2 model; on each, a second thread reads `param.grad is not None`
every half millisecond, as the sampler once did twice a second. With torch 2.13 on Python 3.11 a
rank dies of SIGSEGV within minutes (freeing a gradient in `zero_grad`, or later, in
CPython's allocator); with `--no-reader` the same loop runs clean. Prints what happened and exits
non-zero when a rank crashed.

    .venv/bin/python scripts/repro_grad_read_race.py [--seconds 120] [--no-reader]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(rank: int, world_size: int, port: int, seconds: float, read_grads: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = next(model.parameters())
    stopped = threading.Event()

    def read_grad_presence() -> None:
        while not stopped.wait(0.0005):
            _ = probe.grad is not None

    if read_grads:
        threading.Thread(target=read_grad_presence, daemon=True).start()
    deadline = torch.tensor([time.time() + seconds], dtype=torch.float64)
    dist.broadcast(deadline, src=0)  # every rank runs the same number of steps
    steps = 0
    while True:
        go_on = torch.tensor([time.time() < deadline.item()], dtype=torch.int32)
        dist.all_reduce(go_on, op=dist.ReduceOp.MIN)
        if not go_on.item():
            break
        model(torch.randn(8, 32)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    stopped.set()
    print(f"rank {rank}: {steps} steps, no crash", flush=True)
    dist.barrier()
    os._exit(0)  # gloo's teardown is not what this shows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--no-reader", action="store_true", help="train without the thread that reads .grad")
    args = parser.parse_args()
    import multiprocessing

    port = _free_port()
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_train, args=(rank, 2, port, args.seconds, not args.no_reader))
             for rank in range(2)]
    started = time.monotonic()
    for process in ranks:
        process.start()
    while any(process.is_alive() for process in ranks):
        killed = [(rank, -p.exitcode) for rank, p in enumerate(ranks) if p.exitcode is not None and p.exitcode < 0]
        if killed:
            for process in ranks:
                process.kill()
            rank, signal_number = killed[0]
            print(f"rank {rank} was killed by signal {signal_number} after {time.monotonic() - started:.0f} s",
                  flush=True)
            return 1
        time.sleep(0.5)
    return 0 if all(process.exitcode == 0 for process in ranks) else 1

if __name__ == "__main__":
    sys.exit(main())
