"""Checkpoint benchmark on CPU gloo ranks: save throughput, async stall, HF export memory.

    .venv/bin/python -m benchmarks.bench_checkpoint [--world-size 2] [--hidden 512] [--layers 8]

(run from the repository root: the ranks import this module and the test harness by name)

1. Save throughput: a synchronous Checkpointer.save (DCP shards, fsync, commit) against the same
   number of bytes written by every rank with plain file writes + fsync, in the same run.
   Goal: >= 60 % of the raw speed.
2. Training stall per async save: time the training loop loses to one async save (the save()
   call plus the slow-down of steps while files are written) against the synchronous save time.
   Goal: <= 10 %.
3. HF export peak memory on rank 0: export_hf_model (tensors gathered one at a time, each rank
   writes its own files) against a naive export that gathers the full state dict on rank 0 and
   calls save_pretrained. Peak resident memory above the level before the export.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2nb.checkpoint import Checkpointer, export_hf_model
from fsdp2nb.checkpoint.layout import dir_size
from fsdp2nb.testing.tiny_models import make_tiny_model
from tests.distributed.harness import run_ranks

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


def _save_and_stall(root: str, hidden: int, layers: int, num_steps: int) -> dict:
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

    step_times = []
    for _ in range(num_steps):
        step_times.append(_timed_collectively(lambda: _step(model, optimizer)))
    baseline = statistics.median(step_times)

    with Checkpointer(Path(root) / "async", keep=1, async_save=True) as ckpt:
        ckpt.track(model=model, optimizer=optimizer)
        ckpt.save(0)
        ckpt.wait()
        dist.barrier()
        call_time = _timed_collectively(lambda: ckpt.save(1))
        during = []
        while _any_rank_saving(ckpt) or len(during) < 2:
            during.append(_timed_collectively(lambda: _step(model, optimizer)))
            if len(during) >= 4 * num_steps:
                break
        wait_time = _timed_collectively(ckpt.wait)
    excess = sum(max(0.0, t - baseline) for t in during)
    return dict(ckpt_bytes=ckpt_bytes, sync_time=min(sync_times), raw_time=raw_time, baseline=baseline,
                call_time=call_time, excess=excess, wait_time=wait_time, steps_during=len(during))


def _any_rank_saving(ckpt: Checkpointer) -> bool:
    """Whether a save is still in flight anywhere; agreed so every rank runs the same number of steps."""
    flag = torch.tensor([int(ckpt.status().saving_step is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


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
        export_hf_model(model, out, max_shard_bytes=_EXPORT_SHARD_BYTES)
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("fsdp2nb").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=args.dir) as root:
        save = run_ranks(_save_and_stall, args.world_size, root, args.hidden, args.layers, args.steps)[0]
        ours = run_ranks(_export_memory, args.world_size, root, args.hidden, args.layers, "ours")[0]
        naive = run_ranks(_export_memory, args.world_size, root, args.hidden, args.layers, "naive")[0]

    save_speed = save["ckpt_bytes"] / save["sync_time"]
    raw_speed = save["ckpt_bytes"] / save["raw_time"]
    stall = save["call_time"] + save["excess"] + save["wait_time"]
    rows = [
        ("checkpoint size (model + AdamW)", _mib(save["ckpt_bytes"]), ""),
        ("sync save", f"{save['sync_time']:.3f} s  {_mib(save_speed)}/s", ""),
        ("raw write + fsync, same bytes", f"{save['raw_time']:.3f} s  {_mib(raw_speed)}/s", ""),
        ("save throughput / raw", f"{save_speed / raw_speed:.0%}", "goal >= 60%"),
        ("train step (median, no save)", f"{save['baseline']:.3f} s", ""),
        ("async save() call", f"{save['call_time']:.3f} s", ""),
        (f"extra step time while writing ({save['steps_during']} steps)", f"{save['excess']:.3f} s", ""),
        ("wait() after those steps", f"{save['wait_time']:.3f} s", ""),
        ("stall per async save / sync save", f"{stall / save['sync_time']:.0%}", "goal <= 10%"),
        ("model size (fp32)", _mib(ours["model_bytes"]), ""),
        ("HF export peak RSS rise, rank 0: export_hf_model", f"{_mib(ours['peak'])}  {ours['seconds']:.2f} s", ""),
        ("HF export peak RSS rise, rank 0: gather to rank 0", f"{_mib(naive['peak'])}  {naive['seconds']:.2f} s", ""),
        ("export_hf_model / gather-to-rank-0 peak", f"{ours['peak'] / max(naive['peak'], 1):.0%}", "lower is better"),
    ]
    width = max(len(r[0]) for r in rows)
    logger.info("world size %d, hidden %d, layers %d", args.world_size, args.hidden, args.layers)
    for name, value, goal in rows:
        logger.info("%s  %-28s %s", name.ljust(width), value, goal)


if __name__ == "__main__":
    main()
