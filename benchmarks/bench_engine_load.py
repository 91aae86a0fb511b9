"""Load a ~0.5B-parameter Llama-style checkpoint onto 4 CPU ranks several ways and compare.

  engine               fsdp2nb.load_model(init="meta"): shard on meta, each rank reads its own slices
  naive                shard on meta, then every rank copies every full tensor into private memory
                       (`get_tensor(key).clone()`) and keeps its chunk: a loader that reads whole tensors
  from_pretrained      every rank runs from_pretrained(dtype=float32) on the full model, then shards it
                       (what load_model(init="default") does)
  from_pretrained_bf16 the same with dtype=bfloat16, the usual way to ask for half precision: the cast
                       gives every rank a private bf16 copy of the whole model before sharding (its
                       shards are bf16, half the size of the others')
  disk                 no model: each rank reads its 1/N of the file past the page cache (as dd
                       iflag=direct would), the floor any loader of these bytes stands on here

Run from the repository root:  .venv/bin/python benchmarks/bench_engine_load.py

What is measured, per rank, over the load only (imports, including modeling_llama, happen first):

* anon: growth of RssAnon (private memory) from just before the load to its peak, sampled by a
  thread every 2 ms. The rank's own shard is allocated inside the window, so it is part of this
  number; "overhead" is anon growth minus that shard.
* file: growth of RssFile to its peak. safetensors maps the checkpoint (mmap), and pages a rank
  touches count here. They are shared, clean page cache: one copy on the machine however many
  ranks map them, and the kernel can drop them at any time. They are not memory a rank owns.
* hwm: the kernel's exact peak of total RSS (anon + file + shmem) in the window, reset at its start
  through /proc/self/clear_refs, minus the RSS before. A cross-check for short spikes the sampler
  could miss.
* requested: checkpoint bytes the loader asked for; disk: /proc/self/io read_bytes, real reads,
  meaningful only because the page cache is dropped before each method (the table says if it was).
  Ranks share the page cache, so a page is read from disk once, by whichever rank faults it first,
  and kernel readahead (read_ahead_kb) charges whole windows to that rank.

Why from_pretrained looks cheap here: with safetensors 0.8 and transformers 5, `get_tensor` and
`get_slice(...)[rows]` return views into the mapped file, and from_pretrained keeps those views when
the requested dtype equals the stored one (its fp32 model is a set of views of the file, not a
copy). Sharding then copies only the rank's chunk, touching only those pages, so no rank ever holds
a private copy of a full tensor. Any cast (the bf16 variant) or a loader that copies whole tensors
(naive) loses that. The engine reads the same way: its only private memory is its shard.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.gloo_harness import run_ranks

logger = logging.getLogger("bench_engine_load")

GIB = 1024**3

_MODEL_DIMS = dict(
    vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
    num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
)


def make_checkpoint(directory: Path, dtype_name: str) -> Path:
    """Write (once) a random Llama-style model of about 0.5B parameters as one safetensors file."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (directory / "model.safetensors").is_file():
        return directory
    config = LlamaConfig(**_MODEL_DIMS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    model.save_pretrained(directory, max_shard_size="100GB")
    return directory


# ---- per-process counters --------------------------------------------------------------------

def _io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _status(*fields: str) -> dict[str, int]:
    """Byte values of `fields` ("RssAnon", "RssFile", "VmRSS", "VmHWM") from /proc/self/status."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                found[name] = int(value.split()[0]) * 1024
    return found


def _reset_peak_rss() -> None:
    # "5" resets VmHWM to the current RSS (proc(5), clear_refs), so VmHWM covers the load only.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _PeakSampler:
    """Peaks of RssAnon and RssFile, sampled every `interval` seconds by a daemon thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.peak = _status("RssAnon", "RssFile")
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for name, value in _status("RssAnon", "RssFile").items():
            self.peak[name] = max(self.peak[name], value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Safe to call twice."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()


# ---- the loaders; each returns (model, checkpoint bytes it asked for) -------------------------

def _load_engine(path: str):
    from fsdp2nb.engine import FSDP2Engine, load_model

    engine = FSDP2Engine(mixed_precision="bf16")
    model, _ = load_model(path, init="meta", engine=engine)
    return model, engine.last_load_report.bytes_requested


def _load_naive(path: str):
    """Every rank copies every full tensor out of the file and keeps the chunk it owns."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2nb.engine import FSDP2Engine

    engine = FSDP2Engine(mixed_precision="bf16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    engine.prepare_model(model)
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    requested = 0
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f, torch.no_grad():
        for key in f.keys():
            # get_tensor alone is a view of the mapped file; clone() makes this the full read it
            # stands for (what older safetensors, torch.load without mmap, or a cast would do).
            full = f.get_tensor(key).clone()
            requested += full.numel() * full.element_size()
            param = params[key]
            local = param.to_local() if isinstance(param, DTensor) else param
            chunk = (full.shape[0] + world_size - 1) // world_size  # FSDP2's dim-0 split
            start = min(rank * chunk, full.shape[0])
            local.copy_(full[start:start + local.shape[0]].to(local.dtype))
            del full
    return model, requested


def _from_pretrained(path: str, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp2nb.engine import FSDP2Engine

    engine = FSDP2Engine(mixed_precision="bf16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    engine.prepare_model(model)
    return model, os.path.getsize(os.path.join(path, "model.safetensors"))


def _load_from_pretrained(path: str):
    return _from_pretrained(path, "float32")


def _load_from_pretrained_bf16(path: str):
    return _from_pretrained(path, "bfloat16")


def _read_disk(path: str):
    """This rank's contiguous 1/N of the checkpoint file, read with O_DIRECT into one reused buffer."""
    import mmap

    import torch.distributed as dist
    from torch import nn

    from fsdp2nb.direct_io import BLOCK, open_direct

    file_path = os.path.join(path, "model.safetensors")
    size = os.path.getsize(file_path)
    share = -(-size // dist.get_world_size() // BLOCK) * BLOCK
    start, end = dist.get_rank() * share, min(size, (dist.get_rank() + 1) * share)
    buffer = mmap.mmap(-1, 32 * 1024 * 1024)
    fd, _ = open_direct(file_path, os.O_RDONLY)
    try:
        for offset in range(start, end, len(buffer)):
            os.preadv(fd, [buffer], offset)
    finally:
        os.close(fd)
        buffer.close()
    return nn.Module(), end - start


METHODS = {
    "engine": _load_engine,
    "naive": _load_naive,
    "from_pretrained": _load_from_pretrained,
    "from_pretrained_bf16": _load_from_pretrained_bf16,
    "disk": _read_disk,
}


def _local_bytes(model) -> int:
    """Bytes of this rank's own parameter shards and buffers."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def _measure(method: str, path: str) -> dict[str, float]:
    import torch.distributed as dist
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401  (seconds of imports, not loading)

    import fsdp2nb.engine  # noqa: F401

    dist.barrier()
    before = _status("RssAnon", "RssFile", "VmRSS")
    io_before = _io_counters()
    _reset_peak_rss()
    sampler = _PeakSampler()
    sampler.start()
    start = time.perf_counter()
    model, requested = METHODS[method](path)
    dist.barrier()
    wall = time.perf_counter() - start
    sampler.stop()
    after = _status("RssAnon", "VmHWM")
    io_after = _io_counters()
    return dict(
        wall=wall, requested=requested, disk=io_after["read_bytes"] - io_before["read_bytes"],
        shard=_local_bytes(model),
        anon=sampler.peak["RssAnon"] - before["RssAnon"],
        file=sampler.peak["RssFile"] - before["RssFile"],
        hwm=after["VmHWM"] - before["VmRSS"],
        anon_held=after["RssAnon"] - before["RssAnon"],
    )


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


# ---- report ----------------------------------------------------------------------------------

def _row(cells: list[tuple[str, int]]) -> str:
    return "".join(f"{text:>{width}}" if i else f"{text:<{width}}" for i, (text, width) in enumerate(cells))


def _io_table(results: dict[str, list[dict]], ckpt: int, world_size: int, dropped: dict[str, bool]) -> list[str]:
    head = [("method", 22), ("wall s", 8), ("req/rank GiB", 14), ("req*N/ckpt", 12),
            ("disk/rank max GiB", 19), ("disk max*N/ckpt", 17), ("disk sum/ckpt", 15), ("cache dropped", 15)]
    lines = [_row(head), "-" * sum(w for _, w in head)]
    for method, ranks in results.items():
        req, disk = max(r["requested"] for r in ranks), max(r["disk"] for r in ranks)
        lines.append(_row([
            (method, 22), (f"{max(r['wall'] for r in ranks):.1f}", 8), (f"{req / GIB:.3f}", 14),
            (f"{req * world_size / ckpt:.2f}", 12), (f"{disk / GIB:.3f}", 19),
            (f"{disk * world_size / ckpt:.2f}", 17), (f"{sum(r['disk'] for r in ranks) / ckpt:.2f}", 15),
            (str(dropped[method]), 15),
        ]))
    return lines


def _memory_table(results: dict[str, list[dict]], ckpt: int) -> list[str]:
    head = [("method", 22), ("shard", 8), ("anon", 8), ("overhead", 10), ("held", 8), ("file", 8),
            ("hwm", 8), ("sum anon/ckpt", 15), ("sum (anon+file)/ckpt", 22)]
    lines = [_row(head), "-" * sum(w for _, w in head)]
    for method, ranks in results.items():
        def top(key: str, ranks: list[dict] = ranks) -> str:
            return f"{max(r[key] for r in ranks) / GIB:.3f}"

        overhead = max(r["anon"] - r["shard"] for r in ranks)
        lines.append(_row([
            (method, 22), (top("shard"), 8), (top("anon"), 8), (f"{overhead / GIB:.3f}", 10),
            (top("anon_held"), 8), (top("file"), 8), (top("hwm"), 8),
            (f"{sum(r['anon'] for r in ranks) / ckpt:.2f}", 15),
            (f"{sum(r['anon'] + r['file'] for r in ranks) / ckpt:.2f}", 22),
        ]))
    lines += [
        "GiB per rank, largest over ranks. shard: own parameter shards + buffers; anon: peak RssAnon growth",
        "(shard included); overhead: anon - shard; held: RssAnon growth left after the load; file: peak RssFile",
        "growth (mapped checkpoint pages: shared page cache); hwm: kernel-exact peak VmRSS growth (anon + file).",
        "sum anon/ckpt: sum over ranks of anon, over the checkpoint size; sum (anon+file)/ckpt also counts every",
        "rank's mapped pages as its own (an upper bound: those pages are shared).",
    ]
    return lines


def _goal_lines(results: dict[str, list[dict]], ckpt: int, world_size: int) -> list[str]:
    if "engine" not in results:
        return []
    engine = results["engine"]
    req = max(r["requested"] for r in engine) * world_size / ckpt
    mem = sum(r["anon"] for r in engine) / ckpt
    lines = [
        f"goal  engine bytes requested per rank <= 1.1/N of the checkpoint: {req:.2f}/N "
        f"({'met' if req <= 1.1 else 'NOT met'})",
        f"goal  engine sum over ranks of peak private-memory growth (shards included) <= 1.3x checkpoint: "
        f"{mem:.2f}x ({'met' if mem <= 1.3 else 'NOT met'})",
    ]
    wall = max(r["wall"] for r in engine)
    if "disk" in results:
        lines.append(f"      engine wall over reading the same bytes with dd-like direct reads (the disk's floor): "
                     f"{wall / max(r['wall'] for r in results['disk']):.2f}x")
    for baseline in ("from_pretrained", "from_pretrained_bf16"):
        if baseline in results:
            ratio = wall / max(r["wall"] for r in results[baseline])
            lines.append(f"goal  engine wall <= 0.5x {baseline} wall: {ratio:.2f}x "
                         f"({'met' if ratio <= 0.5 else 'NOT met'})")
    return lines


def _report(
    results: dict[str, list[dict]], ckpt: int, world_size: int, dropped: dict[str, bool], dtype_name: str
) -> str:
    lines = [f"checkpoint {ckpt / GIB:.3f} GiB ({dtype_name} safetensors) on {world_size} gloo ranks", ""]
    lines += _io_table(results, ckpt, world_size, dropped) + [""]
    lines += _memory_table(results, ckpt) + [""]
    lines += _goal_lines(results, ckpt, world_size)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cache-dir", default="/tmp/fsdp2nb-bench-engine-load")
    parser.add_argument("--keep-page-cache", action="store_true", help="do not drop the page cache")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    path = make_checkpoint(Path(args.cache_dir) / args.dtype, args.dtype)
    ckpt = os.path.getsize(path / "model.safetensors")
    results, dropped = {}, {}
    for method in args.methods:
        dropped[method] = not args.keep_page_cache and _drop_page_cache()
        results[method] = run_ranks(_measure, args.world_size, method, str(path))
    sys.stdout.write(_report(results, ckpt, args.world_size, dropped, args.dtype) + "\n")


if __name__ == "__main__":
    main()
