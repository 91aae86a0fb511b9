"""Load a ~0.5B-parameter Llama-style checkpoint onto 4 CPU ranks three ways and compare.

  engine        fsdp2nb.engine.load_model(init="meta"): shard on meta, each rank reads its own slices
  naive         the pre-engine approach, rewritten here as a baseline: shard on meta, then every
                rank reads every full tensor, casts it, and copies out its chunk
  from_pretrained  every rank runs from_pretrained on the full model, then shards it

Run from the repository root:  .venv/bin/python benchmarks/bench_engine_load.py
The checkpoint (fp32 safetensors by default, so its size equals the fp32 training storage) is
cached under /tmp between runs. Before each method the page cache is dropped when this process
may write /proc/sys/vm/drop_caches, so /proc/self/io read_bytes counts real disk reads; the
table says whether that worked. "requested" is the checkpoint bytes the loader asked for.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed.harness import run_ranks  # noqa: E402

logger = logging.getLogger("bench_engine_load")

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


def _io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _current_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    # VmHWM belongs to this process image; ru_maxrss would report the parent's peak, which Linux
    # carries across fork and exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _AnonPeak:
    """Samples RssAnon every few ms: private memory, without the checkpoint's page-cache pages that
    an mmap-ed file adds to VmHWM while it is mapped (those are shared and reclaimable)."""

    def __init__(self) -> None:
        import threading

        self.peak = _status_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_bytes("RssAnon"))

    def __enter__(self) -> _AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_bytes("RssAnon"))


def _load_engine(path: str) -> int:
    from fsdp2nb.engine import FSDP2Engine, load_model

    engine = FSDP2Engine(mixed_precision="bf16")
    load_model(path, init="meta", engine=engine)
    return engine.last_load_report.bytes_requested


def _load_naive(path: str) -> int:
    """Every rank reads every full tensor and casts it before cutting out its chunk."""
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
    rank, world = dist.get_rank(), dist.get_world_size()
    requested = 0
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f, torch.no_grad():
        for key in f.keys():
            full = f.get_tensor(key)
            requested += full.numel() * full.element_size()
            param = params[key]
            full = full.to(param.dtype)
            local = param.to_local() if isinstance(param, DTensor) else param
            chunk = (full.shape[0] + world - 1) // world
            start = min(rank * chunk, full.shape[0])
            local.copy_(full[start:start + local.shape[0]])
    return requested


def _load_from_pretrained(path: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp2nb.engine import FSDP2Engine

    engine = FSDP2Engine(mixed_precision="bf16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine.prepare_model(model)
    return os.path.getsize(os.path.join(path, "model.safetensors"))


METHODS = {"engine": _load_engine, "naive": _load_naive, "from_pretrained": _load_from_pretrained}


def _measure(method: str, path: str) -> dict[str, float]:
    import torch.distributed as dist
    import transformers  # noqa: F401

    import fsdp2nb.engine  # noqa: F401  (imports are not part of the load being timed)

    rss_before, io_before = _current_rss(), _io_counters()
    anon_before = _status_bytes("RssAnon")
    dist.barrier()
    sampler = _AnonPeak().__enter__()
    start = time.perf_counter()
    if os.environ.get("BENCH_PROFILE") and dist.get_rank() == 0:
        import cProfile

        with cProfile.Profile() as profile:
            requested = METHODS[method](path)
        profile.dump_stats(os.environ["BENCH_PROFILE"])
    else:
        requested = METHODS[method](path)
    dist.barrier()
    wall = time.perf_counter() - start
    sampler.__exit__()
    io_after = _io_counters()
    return dict(
        wall=wall, requested=requested, read_bytes=io_after["read_bytes"] - io_before["read_bytes"],
        rchar=io_after["rchar"] - io_before["rchar"], peak_rss=_peak_rss(), rss_before=rss_before,
        anon_growth=sampler.peak - anon_before,
    )


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _table(results: dict[str, list[dict]], checkpoint_bytes: int, world_size: int, dropped: dict[str, bool]) -> str:
    gib = 1024**3
    head = (f"{'method':<16}{'wall s':>8}{'req/rank GiB':>14}{'req/ckpt*N':>12}{'disk read/rank GiB':>20}"
            f"{'peak RSS/rank GiB (VmHWM)':>27}{'sum peak/ckpt':>15}{'sum (peak-start)/ckpt':>23}{'sum anon growth/ckpt':>22}{'cache dropped':>15}")
    lines = [head, "-" * len(head)]
    for method, ranks in results.items():
        wall = max(r["wall"] for r in ranks)
        req = max(r["requested"] for r in ranks)
        disk = max(r["read_bytes"] for r in ranks)
        peak = max(r["peak_rss"] for r in ranks)
        sum_peak = sum(r["peak_rss"] for r in ranks)
        sum_growth = sum(r["peak_rss"] - r["rss_before"] for r in ranks)
        sum_anon = sum(r["anon_growth"] for r in ranks)
        lines.append(
            f"{method:<16}{wall:>8.1f}{req / gib:>14.3f}{req * world_size / checkpoint_bytes:>12.2f}"
            f"{disk / gib:>20.3f}{peak / gib:>27.2f}{sum_peak / checkpoint_bytes:>15.2f}"
            f"{sum_growth / checkpoint_bytes:>23.2f}"
            f"{sum_anon / checkpoint_bytes:>22.2f}{dropped[method]!s:>15}"
        )
    lines.append(f"checkpoint {checkpoint_bytes / gib:.3f} GiB on {world_size} ranks")
    if "engine" in results and "from_pretrained" in results:
        ratio = max(r["wall"] for r in results["engine"]) / max(r["wall"] for r in results["from_pretrained"])
        lines.append(f"engine wall / from_pretrained wall = {ratio:.2f}")
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
    path = make_checkpoint(Path(args.cache_dir) / args.dtype, args.dtype)
    checkpoint_bytes = os.path.getsize(path / "model.safetensors")
    results, dropped = {}, {}
    for method in args.methods:
        dropped[method] = not args.keep_page_cache and _drop_page_cache()
        results[method] = run_ranks(_measure, args.world_size, method, str(path))
    sys.stdout.write(_table(results, checkpoint_bytes, args.world_size, dropped) + "\n")


if __name__ == "__main__":
    main()
