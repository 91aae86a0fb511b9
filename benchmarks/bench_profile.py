"""What `%%fsdp2 --profile` costs: the same training cell on the tiny model, profiled and not,
side by side in one kernel and pool, alternating so that both see the same machine.

The cell trains a few steps of the engine-loaded tiny Llama (fp32, CPU ranks). Each round runs
it once plain and once with `--profile`, in alternating order; the wall time is the notebook's
(from the execute request to its reply: the profile's table and timeline included). The first
profiled cell is reported apart: it pays for loading the profiler once per rank.
Run: .venv/bin/python benchmarks/bench_profile.py [--ranks 2] [--rounds 10] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

SETUP = """%%fsdp2
# token ids below the tiny model's vocabulary (131)
import torch, fsdp2nb
model, _ = fsdp2nb.load_model({model_dir!r}, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, 131, (2, 64), generator=torch.Generator().manual_seed(0))
"""
TRAIN = """
for step in range({steps}):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def cell_s(kernel: Kernel, code: str) -> float:
    started = time.perf_counter()
    run = kernel.execute(code, timeout=600)
    if run.status != "ok":
        raise RuntimeError(run.traceback_text or run.stderr)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from fsdp2nb.examples.tiny_models import save_tiny_checkpoint

    model_dir = os.path.join(tempfile.mkdtemp(prefix="fsdp2nb-bench-"), "model")
    save_tiny_checkpoint(model_dir, "llama")
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        cell_s(kernel, "%load_ext fsdp2nb")
        cell_s(kernel, f"%fsdp2 start --cpu {args.ranks} --no-dashboard")
        cell_s(kernel, SETUP.format(model_dir=model_dir))
        train = TRAIN.format(steps=args.steps)
        cell_s(kernel, "%%fsdp2" + train)  # warm: the first steps allocate
        first_profiled = cell_s(kernel, "%%fsdp2 --profile" + train)
        plain, profiled = [], []
        for round_index in range(args.rounds):
            order = [("plain", "%%fsdp2"), ("profiled", "%%fsdp2 --profile")]
            for name, line in order if round_index % 2 == 0 else order[::-1]:
                (plain if name == "plain" else profiled).append(cell_s(kernel, line + train))
    finally:
        kernel.stop()
    plain_s, profiled_s = statistics.median(plain), statistics.median(profiled)
    ratios = [p / q for p, q in zip(profiled, plain, strict=True)]
    print(f"{args.ranks} CPU ranks, tiny Llama, {args.steps} steps per cell, {args.rounds} rounds")
    print(f"{'':24}{'plain':>10}{'--profile':>12}{'ratio':>8}")
    print(f"{'median cell wall (ms)':24}{plain_s * 1e3:>10.1f}{profiled_s * 1e3:>12.1f}{profiled_s / plain_s:>8.2f}")
    print(f"{'fastest cell wall (ms)':24}{min(plain) * 1e3:>10.1f}{min(profiled) * 1e3:>12.1f}"
          f"{min(profiled) / min(plain):>8.2f}")
    print(f"median of paired ratios: {statistics.median(ratios):.2f}")
    print(f"first profiled cell (loads the profiler on each rank): {first_profiled * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
