"""The last transformer block kept gathered between forward and backward (as the engine shards it)
against resharded after forward (as it did before): step time, all-gathers per step and peak
memory of the tiny Llama-style model on 2 gloo CPU ranks.

Each variant runs in fresh rank processes, alternating, so that each peak RSS (the processes'
high-water mark, `ru_maxrss`) is that variant's alone. Per run: the median step; across runs:
ratios of medians and each round's paired ratio, kept gathered over resharded.
Run: .venv/bin/python benchmarks/bench_last_block.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DIMS = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=2048)
NUM_RANKS = 2


def _train(kept_gathered: bool, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2nb.engine import wrapping
    from fsdp2nb.examples.tiny_models import make_tiny_model

    model = make_tiny_model("llama", **DIMS)
    units = wrapping.shard_unit_list(model)
    wrapping.shard_units(model, mesh=init_device_mesh("cpu", (NUM_RANKS,)), mp_policy=wrapping.mixed_precision_policy("fp32"),
                         offload_policy=None, reshard_after_forward=True)
    if not kept_gathered:
        last_block = [unit for unit in units if unit.kind == "block"][-1].modules[0]
        last_block.set_reshard_after_forward(True)  # as before: resharded, gathered again by backward
    all_gathers = _count_all_gathers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, DIMS["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        all_gathers[0] = 0
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    dist.barrier()
    return {"step_ms": statistics.median(times[5:]) * 1000, "all_gathers": all_gathers[0],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _count_all_gathers() -> list[int]:
    """A counter of the all-gathers FSDP2 issues (through `all_gather_single` in torch 2.13, else
    `all_gather_into_tensor`), reset by the caller each step."""
    import torch.distributed as dist

    count = [0]
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    return count


def main() -> None:
    from tests.support.gloo_harness import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.rounds):
        for kept in (False, True):
            results[kept].append(max(run_ranks(_train, NUM_RANKS, kept, args.steps), key=lambda r: r["peak_rss_mib"]))
    print(f"tiny Llama ({DIMS['num_hidden_layers']} blocks, hidden {DIMS['hidden_size']}), fp32, {NUM_RANKS} gloo CPU "
          f"ranks, {args.rounds} alternating runs of {args.steps} steps; the larger rank's peak RSS")
    for key, label in (("step_ms", "median step (ms)"), ("all_gathers", "all-gathers per step"),
                       ("peak_rss_mib", "peak RSS (MiB)")):
        resharded = statistics.median(r[key] for r in results[False])
        kept = statistics.median(r[key] for r in results[True])
        paired = sorted(k[key] / r[key] for k, r in zip(results[True], results[False], strict=True))
        print(f"  {label:>22}: resharded {resharded:.1f}, kept gathered {kept:.1f}, ratio of medians "
              f"{kept / resharded:.3f}, paired ratios {' '.join(f'{ratio:.3f}' for ratio in paired)}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
