"""Checkpoint benchmark on CPU gloo ranks: save throughput, async stall, HF export memory.

    .venv/bin/python -m benchmarks.bench_checkpoint [--world-size 2] [--hidden 512] [--layers 8]

(run from the repository root: the ranks import this module by name)

1. Save throughput: a synchronous Checkpointer.save (DCP shards, fsync, commit) against the same
   number of bytes written by every rank with plain file writes + fsync, in the same run.
   Goal: >= 60 % of the raw speed.
2. Training stall per async save, for both async writers (a thread, the default, and DCP's
   writer process): the time training waits on the save (the save() call and the next optimizer
   step's wait for the copy, `Checkpointer.blocked_s`) against the synchronous save time.
   Goal: <= 10 %. Beside it, the interference: in rounds of one run, k training steps alone
   against save() + the same k steps + wait() (k steps outlast a synchronous save), and the
   CPU time the save's background work took. Where training keeps every core busy (2 CPU ranks
   on 2 cores) the steps slow down by about that CPU time; with a core to spare they need not.
3. What checksums cost: a synchronous save with each shard's CRC32 computed while it is written,
   against the same save without, and a load that first reads every file to check its CRC32
   against one that checks sizes only; side by side, in alternating order, in one run.
4. HF export peak memory on rank 0: export_hf (tensors gathered one at a time, each rank
   writes its own files) against a naive export that gathers the full state dict on rank 0 and
   calls save_pretrained. Peak resident memory above the level before the export.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2nb import Checkpointer, export_hf
from fsdp2nb.checkpoint.config import ASYNC_WRITERS
from fsdp2nb.checkpoint.layout import dir_size
from fsdp2nb.examples.tiny_models import make_tiny_model
from tests.support.gloo_harness import run_ranks

logger = logging.getLogger("bench_checkpoint")
_CHUNK = 16 * 1024**2
# Each rank flushes a file once it holds this much: its memory is bounded by this plus one full tensor.
_EXPORT_SHARD_BYTES = 32 * 1024**2


def _build(hidden: int, layers: int):
    from torch.distributed.fsdp import fully_shard

    model = make_tiny_model("llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                            vocab_size=8192)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _step(model, optimizer) -> None:
    ids = torch.randint(0, 8192, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _timed_collectively(fn) -> float:
    """Wall time of `fn` across all ranks: from a common start to the last rank's finish."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _raw_write(path: Path, num_bytes: int) -> None:
    payload = os.urandom(_CHUNK)
    with open(path, "wb") as f:
        written = 0
        while written < num_bytes:
            chunk = payload[: min(_CHUNK, num_bytes - written)]
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())


def _save_and_stall(root: str, hidden: int, layers: int, rounds: int) -> dict:
    rank = dist.get_rank()
    model, optimizer = _build(hidden, layers)
    _step(model, optimizer)  # optimizer state exists, as in a real run

    sync_dir = Path(root) / "sync"
    with Checkpointer(sync_dir, keep=1, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer)
        ckpt.save(0)  # warm-up: first-save costs (imports, planner caches) are not throughput
        sync_times = [_timed_collectively(lambda s=s: ckpt.save(s)) for s in (1, 2)]
    ckpt_bytes = dir_size(sync_dir / "step-000002")
    rank_bytes = ckpt_bytes // dist.get_world_size()
    raw_path = Path(root) / f"raw-{rank}.bin"
    raw_time = _timed_collectively(lambda: _raw_write(raw_path, rank_bytes))
    raw_path.unlink()

    return dict(ckpt_bytes=ckpt_bytes, sync_time=min(sync_times), raw_time=raw_time,
                **_async_stall(Path(root), model, optimizer, min(sync_times), rounds))


def _async_stall(root: Path, model, optimizer, sync_time: float, rounds: int) -> dict:
    """Side by side in one run: k steps alone, and save() + the same k steps + wait() per writer.

    k is chosen so that k steps last longer than a synchronous save: a perfect async save then
    costs nothing. Each round runs the three variants in a rotated order, so drift (other load on
    the machine, caches warming) falls on all of them alike; the stall of a writer in a round is
    its time minus the plain steps' time of that round, and the median over rounds is reported.
    """
    step_time = statistics.median(_timed_collectively(lambda: _step(model, optimizer)) for _ in range(3))
    num_steps = max(2, math.ceil(1.5 * sync_time / step_time))

    def steps() -> None:
        for _ in range(num_steps):
            _step(model, optimizer)

    times: dict[str, list[float]] = {name: [] for name in ("plain", *ASYNC_WRITERS)}
    calls: dict[str, list[float]] = {name: [] for name in ASYNC_WRITERS}
    waits: dict[str, list[float]] = {name: [] for name in ASYNC_WRITERS}
    blocked: dict[str, list[float]] = {name: [] for name in ASYNC_WRITERS}
    background_cpu: dict[str, list[float]] = {name: [] for name in ASYNC_WRITERS}
    ckpts = {name: Checkpointer(root / f"async-{name}", keep=1, async_save=True, async_writer=name)
             for name in ASYNC_WRITERS}
    try:
        for ckpt in ckpts.values():
            ckpt.track(model=model, optimizer=optimizer)
            ckpt.save(0)  # warm-up: staging buffers allocated, writer process started
            ckpt.wait()

        def save_steps_wait(name: str, step: int) -> None:
            blocked_before = ckpts[name].blocked_s
            start = time.perf_counter()
            ckpts[name].save(step)
            calls[name].append(time.perf_counter() - start)
            steps()
            start = time.perf_counter()
            ckpts[name].wait()
            waits[name].append(time.perf_counter() - start)
            blocked[name].append(ckpts[name].blocked_s - blocked_before)

        def alone(name: str, step: int) -> None:
            """The CPU time of a save with nothing else running in the rank."""
            cpu_before = _cpu_seconds()
            ckpts[name].save(step)
            ckpts[name].wait()
            background_cpu[name].append(_cpu_seconds() - cpu_before)

        variants = list(times)
        for i in range(rounds):
            for name in variants[i % 3:] + variants[:i % 3]:
                run = steps if name == "plain" else lambda name=name, step=i + 1: save_steps_wait(name, step)
                times[name].append(_timed_collectively(run))
        for name in ASYNC_WRITERS:
            for step in (rounds + 1, rounds + 2):
                _timed_collectively(lambda name=name, step=step: alone(name, step))
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    result = dict(step_time=step_time, num_steps=num_steps, plain=statistics.median(times["plain"]))
    for name in ASYNC_WRITERS:
        stalls = [t - p for t, p in zip(times[name], times["plain"], strict=True)]
        result[name] = dict(total=statistics.median(times[name]), stall=statistics.median(stalls),
                            stall_range=(min(stalls), max(stalls)), call_time=statistics.median(calls[name]),
                            wait_time=statistics.median(waits[name]), blocked=statistics.median(blocked[name]),
                            background_cpu=statistics.median(background_cpu[name]))
    return result


def _checksum_cost(root: str, hidden: int, layers: int, rounds: int) -> dict:
    """Median save and load times with checksums on and off, measured in alternating order."""
    model, optimizer = _build(hidden, layers)
    _step(model, optimizer)
    ckpts = {on: Checkpointer(Path(root) / f"checksums-{on}", keep=1, async_save=False, checksums=on)
             for on in (True, False)}
    saves: dict[bool, list[float]] = {True: [], False: []}
    loads: dict[bool, list[float]] = {True: [], False: []}
    try:
        for ckpt in ckpts.values():
            ckpt.track(model=model, optimizer=optimizer).save(0)  # warm-up
        for i in range(rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for on in order:
                saves[on].append(_timed_collectively(lambda on=on, step=i + 1: ckpts[on].save(step)))
            for on in order:
                loads[on].append(_timed_collectively(lambda on=on, step=i + 1: ckpts[on].load(step)))
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    return {f"{kind}_{'on' if on else 'off'}": statistics.median(times[on])
            for kind, times in (("save", saves), ("load", loads)) for on in (True, False)}


def _cpu_seconds() -> float:
    """CPU time of this rank's process, all threads (not DCP's writer process)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


class _PeakRss:
    """Samples this process's resident memory every 2 ms until stopped; reports the peak rise."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self.start_rss = self._rss()
        self.peak = self.start_rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        return self.peak - self.start_rss


def _naive_export(model, out: Path) -> None:
    """The baseline: the whole state dict gathered on rank 0, which writes everything."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(out, state_dict=state)
    dist.barrier()


def _export_memory(root: str, hidden: int, layers: int, method: str) -> dict:
    model, _ = _build(hidden, layers)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensor numel is global
    out = Path(root) / method
    dist.barrier()
    meter = _PeakRss()
    start = time.perf_counter()
    if method == "ours":
        export_hf(model, out, max_shard_bytes=_EXPORT_SHARD_BYTES)
    else:
        _naive_export(model, out)
    elapsed = time.perf_counter() - start
    return dict(peak=meter.stop(), seconds=elapsed, model_bytes=model_bytes)


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 1024**2:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds for the async stall")
    parser.add_argument("--skip-export", action="store_true", help="no HF export measurement")
    parser.add_argument("--only-checksums", action="store_true", help="only what checksums cost")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("fsdp2nb").setLevel(logging.WARNING)

    shape = (args.world_size, args.hidden, args.layers)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=args.dir) as root:
        sums = run_ranks(_checksum_cost, args.world_size, root, args.hidden, args.layers, args.rounds)[0]
        if args.only_checksums:
            _report(_checksum_rows(sums, args.rounds), shape)
            return
        save = run_ranks(_save_and_stall, args.world_size, root, args.hidden, args.layers, args.rounds)[0]
        if not args.skip_export:
            ours = run_ranks(_export_memory, args.world_size, root, args.hidden, args.layers, "ours")[0]
            naive = run_ranks(_export_memory, args.world_size, root, args.hidden, args.layers, "naive")[0]

    save_speed = save["ckpt_bytes"] / save["sync_time"]
    raw_speed = save["ckpt_bytes"] / save["raw_time"]
    rows = [
        ("checkpoint size (model + AdamW)", _mib(save["ckpt_bytes"]), ""),
        ("sync save", f"{save['sync_time']:.3f} s  {_mib(save_speed)}/s", ""),
        ("raw write + fsync, same bytes", f"{save['raw_time']:.3f} s  {_mib(raw_speed)}/s", ""),
        ("save throughput / raw", f"{save_speed / raw_speed:.0%}", "goal >= 60%"),
        ("train step (median)", f"{save['step_time']:.3f} s", ""),
        (f"{save['num_steps']} steps, no save (median of {args.rounds})", f"{save['plain']:.3f} s", ""),
    ]
    for name in ASYNC_WRITERS:
        r = save[name]
        low, high = r["stall_range"]
        rows += [
            (f"[{name}] save() + {save['num_steps']} steps + wait() (median)", f"{r['total']:.3f} s", ""),
            (f"[{name}]   of which the save() call", f"{r['call_time']:.3f} s", ""),
            (f"[{name}]   of which wait() after the steps", f"{r['wait_time']:.3f} s", ""),
            (f"[{name}] training blocked per async save (median)", f"{r['blocked']:.3f} s", ""),
            (f"[{name}] stall per async save / sync save", f"{r['blocked'] / save['sync_time']:.0%}",
             "goal <= 10%"),
            (f"[{name}] slow-down of the overlapped steps (median, min..max)",
             f"{r['stall']:.3f} s  {low:.2f}..{high:.2f}", f"{r['stall'] / save['sync_time']:.0%} of sync save"),
            (f"[{name}] CPU time of one save in the rank, no training", f"{r['background_cpu']:.3f} s",
             "(not counting the writer process)" if name == "process" else ""),
        ]
    rows += _checksum_rows(sums, args.rounds)
    if not args.skip_export:
        rows += [
            ("model size (fp32)", _mib(ours["model_bytes"]), ""),
            ("HF export peak RSS rise, rank 0: export_hf", f"{_mib(ours['peak'])}  {ours['seconds']:.2f} s", ""),
            ("HF export peak RSS rise, rank 0: gather to rank 0", f"{_mib(naive['peak'])}  {naive['seconds']:.2f} s", ""),
            ("export_hf / gather-to-rank-0 peak", f"{ours['peak'] / max(naive['peak'], 1):.0%}", "lower is better"),
        ]
    _report(rows, shape)


def _checksum_rows(sums: dict, rounds: int) -> list[tuple[str, str, str]]:
    return [
        (f"sync save, CRC32s computed (median of {rounds})", f"{sums['save_on']:.3f} s", ""),
        (f"sync save, no CRC32s (median of {rounds})", f"{sums['save_off']:.3f} s", ""),
        ("save with / without CRC32s", f"{sums['save_on'] / sums['save_off']:.0%}", ""),
        (f"load, CRC32s checked first (median of {rounds})", f"{sums['load_on']:.3f} s", ""),
        (f"load, sizes checked only (median of {rounds})", f"{sums['load_off']:.3f} s", ""),
        ("load with / without checking CRC32s", f"{sums['load_on'] / sums['load_off']:.0%}", ""),
    ]


def _report(rows: list[tuple[str, str, str]], shape: tuple[int, int, int]) -> None:
    width = max(len(r[0]) for r in rows)
    logger.info("world size %d, hidden %d, layers %d", *shape)
    for name, value, goal in rows:
        logger.info("%s  %-28s %s", name.ljust(width), value, goal)


if __name__ == "__main__":
    main()
