"""What a snapshot in host memory every step (`memory_every=1`) costs a training step.

One kernel, one pool of 2 CPU ranks, the tiny Llama the tests train (fp32, AdamW). In one cell the
same training loop alternates blocks of steps that call `maybe_save` on a Checkpointer without
snapshots and on one with `memory_every=1` (both track the same model and optimizer, so both
blocks pay the same agreement on save requests); per round, the median step of each, and across
rounds the median of the paired ratios. Also printed: the copy's own time per snapshot (on its
thread) and the restore's time in a new pool.
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
    times = []
    for step in range(first, first + count):
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        fsdp2nb.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        checkpointer.maybe_save(step)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1000
"""

ROUND = """%%fsdp2
step = globals().get("step", 0)
copied_before = snapshots._memory.copy_s
plain_ms = steps(plain, step, 20); step += 20
snapshot_ms = steps(snapshots, step, 20); step += 20
snapshots.wait()
copy_ms = (snapshots._memory.copy_s - copied_before) / 20 * 1000
if rank == 0:
    print("ROUND", plain_ms, snapshot_ms, copy_ms)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for line in ("%load_ext fsdp2nb", "%fsdp2 start --cpu 2 --no-dashboard",
                         f"%%fsdp2\nMODEL_DIR = {workdir + '/model'!r}\nCKPT_DIR = {workdir + '/ckpt'!r}", SETUP):
                run = kernel.execute(line, timeout=600)
                assert run.status == "ok", run.traceback_text
            rounds = [_round(kernel) for _ in range(args.rounds)]
            restore_s = _restore_in_new_pool(kernel, workdir)
            kernel.execute("%fsdp2 stop")
    finally:
        kernel.stop()
    ratios = [snapshot / plain for plain, snapshot, _ in rounds]
    for plain, snapshot, copy in rounds:
        print(f"step {plain:.2f} ms without, {snapshot:.2f} ms with a snapshot every step "
              f"(x{snapshot / plain:.3f}); the copy itself {copy:.2f} ms on its thread")
    print(f"memory_every=1 vs none, median of paired ratios: x{statistics.median(ratios):.3f} "
          f"({len(ratios)} rounds of 20 steps each, 2 CPU ranks, tiny Llama fp32)")
    print(f"restoring the snapshot in a new pool: {restore_s}")


def _round(kernel: Kernel) -> tuple[float, float, float]:
    run = kernel.execute(ROUND, timeout=600)
    assert run.status == "ok", run.traceback_text
    plain, snapshot, copy = re.search(r"ROUND (\S+) (\S+) (\S+)", run.stdout).groups()
    return float(plain), float(snapshot), float(copy)


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
