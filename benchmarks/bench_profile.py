"""What `%%fsdp2 --profile` costs: the same training cell on the tiny model, profiled and not,
side by side in one kernel and pool, alternating so that both see the same machine.

The cell trains a few steps of the engine-loaded tiny Llama (fp32, CPU ranks). Each round runs
it once plain and once with `--profile`, in alternating order. The wall time is the notebook's,
from the execute request to its reply: what a user waits for. A profiled cell's ranks reply
first and send their profiles after, so the time until its view replaced the placeholder
(`update_display_data`) is reported beside it; the next cell starts only then, so that it does
not pay for the profile. The first profiled cell is reported apart: it pays for loading the
profiler once per rank.

Then each rank times the parts of a profile itself, the same steps run plain and profiled in one
cell (medians over the rounds, wall time on the rank): recording while the steps run, stopping
the profiler (torch builds its results), reading and summing the events (`rank_profile`), and
the bytes the rank sends.
Run: .venv/bin/python benchmarks/bench_profile.py [--ranks 2] [--rounds 10] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
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

PARTS = """%%fsdp2
import json, pickle, statistics, time
from torch.autograd.profiler import profile as _autograd_profile, record_function as _record_function
from fsdp2nb.profile_analysis import collector_paused as _collector_paused
from fsdp2nb.worker.profiling import WINDOW_NAME as _WINDOW, ProfileSink as _Sink, rank_profile as _rank_profile

def _train():
{train}
_parts = []
for _ in range({rounds}):
    _started = time.perf_counter()
    _train()
    _plain = time.perf_counter() - _started
    _profiler = _autograd_profile(use_cpu=True, use_kineto=True)
    _started = time.perf_counter()
    _profiler.__enter__()
    with _record_function(_WINDOW):
        _train()
    _ran = time.perf_counter()
    _profiler.__exit__(None, None, None)
    _stopped = time.perf_counter()
    with _collector_paused():
        _recorded = _rank_profile(_Sink(rank, "cpu", print, lambda: None), _profiler.kineto_results)
    _parts.append(dict(plain_ms=_plain * 1e3, recording_ms=(_ran - _started) * 1e3,
                       stop_ms=(_stopped - _ran) * 1e3, read_and_sum_ms=(time.perf_counter() - _stopped) * 1e3,
                       events=len(_recorded.ops) // 40, sent_kb=len(pickle.dumps(_recorded)) / 1e3))
print(json.dumps({{key: statistics.median(part[key] for part in _parts) for key in _parts[0]}}))
"""


def rank_parts(kernel: Kernel, train: str, rounds: int) -> dict[str, dict[str, float]]:
    """rank -> the medians of its profile's parts (PARTS)."""
    run = kernel.execute(PARTS.format(train=textwrap.indent(train.strip(), "    "), rounds=rounds), timeout=600)
    if run.status != "ok":
        raise RuntimeError(run.traceback_text or run.stderr)
    return {line.split("] ", 1)[0].lstrip("["): json.loads(line.split("] ", 1)[1])
            for line in run.stdout.splitlines() if line.startswith("[")}


def cell_s(kernel: Kernel, code: str) -> float:
    started = time.perf_counter()
    run = kernel.execute(code, timeout=600)
    if run.status != "ok":
        raise RuntimeError(run.traceback_text or run.stderr)
    return time.perf_counter() - started


def profiled_cell_s(kernel: Kernel, code: str) -> tuple[float, float]:
    """A profiled cell's wall time until its reply, and until its profile view arrived."""
    started = time.perf_counter()
    run = kernel.execute(code, timeout=600)
    replied = time.perf_counter() - started
    if run.status != "ok":
        raise RuntimeError(run.traceback_text or run.stderr)
    (display_id,) = run.display_ids
    kernel.display_update(run, display_id, timeout=600)
    return replied, time.perf_counter() - started


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
        first_profiled, _ = profiled_cell_s(kernel, "%%fsdp2 --profile" + train)
        plain, profiled, viewed = [], [], []
        for round_index in range(args.rounds):
            for name in ("plain", "profiled") if round_index % 2 == 0 else ("profiled", "plain"):
                if name == "plain":
                    plain.append(cell_s(kernel, "%%fsdp2" + train))
                else:
                    replied, view_arrived = profiled_cell_s(kernel, "%%fsdp2 --profile" + train)
                    profiled.append(replied)
                    viewed.append(view_arrived)
        parts = rank_parts(kernel, train, args.rounds)
    finally:
        kernel.stop()
    plain_s, profiled_s = statistics.median(plain), statistics.median(profiled)
    ratios = [p / q for p, q in zip(profiled, plain, strict=True)]
    print(f"{args.ranks} CPU ranks, tiny Llama, {args.steps} steps per cell, {args.rounds} rounds")
    print(f"{'':24}{'plain':>10}{'--profile':>12}{'ratio':>8}")
    print(f"{'median cell wall (ms)':24}{plain_s * 1e3:>10.1f}{profiled_s * 1e3:>12.1f}{profiled_s / plain_s:>8.2f}")
    print(f"{'fastest cell wall (ms)':24}{min(plain) * 1e3:>10.1f}{min(profiled) * 1e3:>12.1f}"
          f"{min(profiled) / min(plain):>8.2f}")
    viewed_s = statistics.median(viewed)
    print(f"{'median until view (ms)':24}{'':>10}{viewed_s * 1e3:>12.1f}{viewed_s / plain_s:>8.2f}")
    print(f"median of paired ratios: {statistics.median(ratios):.2f} until the reply, "
          f"{statistics.median(v / q for v, q in zip(viewed, plain, strict=True)):.2f} until the view")
    print(f"first profiled cell (loads the profiler on each rank): {first_profiled * 1e3:.1f} ms")
    print("on each rank, medians (ms; events and kB per profile):")
    for rank, medians in sorted(parts.items()):
        print(f"  rank {rank}: " + ", ".join(f"{key} {value:.1f}" for key, value in medians.items()))


if __name__ == "__main__":
    main()
