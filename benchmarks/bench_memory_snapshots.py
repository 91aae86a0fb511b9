"""What a snapshot in host memory every step (`memory_every=1`) costs a training step.

One kernel, one pool of 2 CPU ranks, the tiny Llama the tests train (fp32, AdamW). In one cell the
same training loop alternates blocks of 6 steps that call `maybe_save` on a Checkpointer without
snapshots and on one with `memory_every=1` (both track the same model and optimizer, so both
blocks pay the same agreement on save requests). Per round, the median of the blocks' paired
ratios of their median step, in wall time and in the rank's CPU time (all its threads: less moved
by other work on a shared machine); across rounds, the median. Also printed: the copy's own time
per snapshot (on its thread) and the restore's time in a new pool.
Run: .venv/bin/python -m benchmarks.bench_memory_snapshots [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

SETUP = """%%fsdp2
import time, statistics, torch, fsdp2nb
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
if rank == 0:
    save_tiny_checkpoint(MODEL_DIR, "llama")
dist.barrier()
model, _ = fsdp2nb.load_model(MODEL_DIR, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
plain = fsdp2nb.Checkpointer(CKPT_DIR + "-plain").track(model=model, optimizer=optimizer)
snapshots = fsdp2nb.Checkpointer(CKPT_DIR, memory_every=1).track(model=model, optimizer=optimizer)
ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(rank))

def steps(checkpointer, first, count):
    # The median wall and CPU time (every thread of the rank) of `count` steps, the first left
    # out: it may pay for the other kind's last copy.
    walls, cpus = [], []
    for step in range(first, first + count):
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        fsdp2nb.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        checkpointer.maybe_save(step)
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu_started)
    return statistics.median(walls[1:]) * 1000, statistics.median(cpus[1:]) * 1000
"""

ROUND = """%%fsdp2
step = globals().get("step", 0)
copied_before, taken_before = snapshots._memory.snapshots.copy_s, snapshots._memory.snapshots.num_taken
blocked_before = snapshots.blocked_s
pairs = []
for _ in range(BLOCKS):
    plain_ms = steps(plain, step, 6); step += 6
    snapshot_ms = steps(snapshots, step, 6); step += 6
    pairs.append((plain_ms, snapshot_ms))
snapshots.wait()
num_taken = snapshots._memory.snapshots.num_taken - taken_before
copy_ms = (snapshots._memory.snapshots.copy_s - copied_before) / num_taken * 1000
blocked_ms = (snapshots.blocked_s - blocked_before) / num_taken * 1000
wall = statistics.median(b[0] / a[0] for a, b in pairs)
cpu = statistics.median(b[1] / a[1] for a, b in pairs)
plain_wall = statistics.median(a[0] for a, _ in pairs)
if rank == 0:
    print("ROUND", plain_wall, wall, cpu, copy_ms, blocked_ms)
"""
BLOCKS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for line in ("%load_ext fsdp2nb", "%fsdp2 start --cpu 2 --no-dashboard",
                         f"%%fsdp2\nMODEL_DIR = {workdir + '/model'!r}\nCKPT_DIR = {workdir + '/ckpt'!r}\n"
                         f"BLOCKS = {BLOCKS}", SETUP):
                run = kernel.execute(line, timeout=600)
                assert run.status == "ok", run.traceback_text
            rounds = [_round(kernel) for _ in range(args.rounds)]
            restore_s = _restore_in_new_pool(kernel, workdir)
            kernel.execute("%fsdp2 stop")
    finally:
        kernel.stop()
    for plain_ms, wall, cpu, copy, blocked in rounds:
        print(f"step {plain_ms:.2f} ms without; with a snapshot every step x{wall:.3f} wall, x{cpu:.3f} CPU "
              f"(median of {BLOCKS} paired blocks); the copy {copy:.2f} ms on its thread, training blocked "
              f"{blocked:.2f} ms (taking it, and the optimizer step's wait for it)")
    print(f"memory_every=1 vs none, median over {len(rounds)} rounds: x{statistics.median(r[1] for r in rounds):.3f} "
          f"wall, x{statistics.median(r[2] for r in rounds):.3f} CPU per step (2 CPU ranks, tiny Llama fp32)")
    print(f"restoring the snapshot in a new pool: {restore_s}")


def _round(kernel: Kernel) -> tuple[float, ...]:
    run = kernel.execute(ROUND, timeout=600)
    assert run.status == "ok", run.traceback_text
    return tuple(float(value) for value in re.search(r"ROUND (.*)", run.stdout).group(1).split())


def _restore_in_new_pool(kernel: Kernel, workdir: str) -> str:
    run = kernel.execute("%fsdp2 restart", timeout=600)
    assert run.status == "ok", run.traceback_text
    kernel.execute(f"%%fsdp2\nMODEL_DIR = {workdir + '/model'!r}\nCKPT_DIR = {workdir + '/ckpt'!r}")
    run = kernel.execute(SETUP.replace("    save_tiny_checkpoint(MODEL_DIR, \"llama\")", "    pass"), timeout=600)
    assert run.status == "ok", run.traceback_text
    found = re.search(r"restored step \d+ from memory in \S+ s", run.stdout)
    return found.group(0) if found else "not restored: " + run.stdout


if __name__ == "__main__":
    main()
