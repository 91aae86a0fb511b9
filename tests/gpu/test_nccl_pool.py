"""GPU checks (NCCL pool, device assignment, engine on GPUs). Run by scripts/gpu_check.sh."""

import pytest
import torch

from tests.support.kernel_client import Kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
]


@pytest.fixture(scope="module")
def gpu_kernel():
    k = Kernel()
    k.execute("%load_ext fsdp2nb")
    num_gpus = min(torch.cuda.device_count(), 4)
    run = k.execute(f"%fsdp2 start --gpus {num_gpus}")
    assert run.status == "ok", run.stderr
    k.num_gpus = num_gpus
    yield k
    k.stop()


def every_rank_printed(num_ranks: int, text: str) -> str:
    """How the cell shows a line that every rank printed: labelled `[all]` only with several ranks."""
    return f"[all] {text}" if num_ranks > 1 else text


def test_each_rank_owns_its_gpu_and_nccl_works(gpu_kernel):
    run = gpu_kernel.execute("%%fsdp2\nx = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(x)\n"
                             "print(rank, device, torch.cuda.current_device(), dist.get_backend(), x.item())")
    assert run.status == "ok", run.traceback_text
    n = gpu_kernel.num_gpus
    for rank in range(n):
        assert f"{rank} cuda:{rank} {rank} " in run.stdout
    assert f"{n * (n + 1) / 2}" in run.stdout


def _allocated_mib_by_rank(status_text: str) -> dict[int, int]:
    """Each rank's allocated device memory from `%fsdp2 status` ("rank pid device ... A MiB / T MiB")."""
    import re

    rows = re.findall(r"^(\d+)\s.*?([\d,]+) MiB / [\d,]+ MiB\s*$", status_text, flags=re.MULTILINE)
    return {int(rank): int(allocated.replace(",", "")) for rank, allocated in rows}


def test_status_shows_the_device_memory_each_rank_allocated(gpu_kernel):
    run = gpu_kernel.execute("%%fsdp2\nblock = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)")
    assert run.status == "ok", run.traceback_text
    import time

    deadline = time.monotonic() + 10  # ranks send a snapshot twice a second: wait for one after the cell
    while True:
        allocated = _allocated_mib_by_rank(gpu_kernel.execute("%fsdp2 status").stdout)
        if all(allocated.get(rank, 0) >= 256 for rank in range(gpu_kernel.num_gpus)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(allocated) == list(range(gpu_kernel.num_gpus)), allocated
    assert all(mib >= 256 for mib in allocated.values()), allocated


def test_engine_bf16_and_offload_on_gpus(gpu_kernel, tmp_path):
    gpu_kernel.execute(f"path = {str(tmp_path / 'tiny')!r}\n%fsdp2 push path")
    run = gpu_kernel.execute("%%fsdp2\nimport fsdp2nb\nfrom fsdp2nb.examples.tiny_models import save_tiny_checkpoint\n"
                             "if rank == 0: save_tiny_checkpoint(path, 'qwen2', tie_word_embeddings=True)\n"
                             "dist.barrier()\n"
                             "for offload in (False, True):\n"
                             "    engine = fsdp2nb.FSDP2Engine(mixed_precision='bf16', offload_params=offload)\n"
                             "    model, _ = fsdp2nb.load_model(path, engine=engine)\n"
                             "    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
                             "    ids = torch.randint(0, 100, (2, 16), device=device)\n"
                             "    losses = []\n"
                             "    for _ in range(5):\n"
                             "        loss = model(input_ids=ids, labels=ids).loss; loss.backward()\n"
                             "        fsdp2nb.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()\n"
                             "        losses.append(loss.item())\n"
                             "    print('offload', offload, 'falls', losses[-1] < losses[0])", timeout=600)
    assert run.status == "ok", run.traceback_text
    n = gpu_kernel.num_gpus
    assert every_rank_printed(n, "offload False falls True") in run.stdout
    assert every_rank_printed(n, "offload True falls True") in run.stdout


def test_cold_checkpoint_loads_with_direct_reads_and_async_save_restores_on_gpus(gpu_kernel, tmp_path):
    gpu_kernel.execute(f"path = {str(tmp_path / 'cold')!r}\nckpt_dir = {str(tmp_path / 'ckpt')!r}\n"
                       "%fsdp2 push path ckpt_dir")
    run = gpu_kernel.execute(
        "%%fsdp2\nimport os, fsdp2nb\nfrom fsdp2nb.examples.tiny_models import save_tiny_checkpoint\n"
        # Larger than the disk's read-ahead, then evicted: the load must take the direct path.
        "if rank == 0:\n"
        "    save_tiny_checkpoint(path, 'llama', vocab_size=40_000, intermediate_size=30_000)\n"
        "    fd = os.open(os.path.join(path, 'model.safetensors'), os.O_RDONLY)\n"
        "    os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)\n"
        "dist.barrier()\n"
        "engine = fsdp2nb.FSDP2Engine(mixed_precision='bf16')\n"
        "model, _ = fsdp2nb.load_model(path, engine=engine)\n"
        "print('direct', engine.last_load_report.direct_io)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "ids = torch.randint(0, 100, (2, 16), device=device)\n"
        "def train_step():\n"
        "    model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()\n"
        "def full_state():\n"
        "    return {k: getattr(v, 'full_tensor', lambda v=v: v)().cpu() for k, v in model.state_dict().items()}\n"
        "train_step()\n"
        "ckpt = fsdp2nb.Checkpointer(ckpt_dir, async_save=True).track(model=model, optimizer=opt)\n"
        "at_save = full_state()\n"
        "ckpt.save(1)\n"
        "train_step()  # its optimizer step waits for the pinned-memory copy\n"
        "ckpt.wait()\n"
        "ckpt.load(1)\n"
        "print('restored', all(torch.equal(t, at_save[k]) for k, t in full_state().items()))\n"
        "ckpt.close()", timeout=600)
    assert run.status == "ok", run.traceback_text
    assert every_rank_printed(gpu_kernel.num_gpus, "restored True") in run.stdout
    assert "direct True" in run.stdout


def test_snapshots_in_host_memory_copy_from_gpus_and_restore_after_a_restart(gpu_kernel, tmp_path):
    """memory_every=1 copies device to page-locked host memory; a restarted pool restores it bitwise."""
    setup = (f"%%fsdp2\nimport fsdp2nb, os\nfrom fsdp2nb.examples.tiny_models import save_tiny_checkpoint\n"
             f"path, ckpt_dir = {str(tmp_path / 'model')!r}, {str(tmp_path / 'ckpt')!r}\n"
             "if rank == 0 and not os.path.exists(os.path.join(path, 'config.json')):\n"
             "    save_tiny_checkpoint(path, 'llama')\n"
             "dist.barrier()\n"
             "model, _ = fsdp2nb.load_model(path, engine=fsdp2nb.FSDP2Engine(mixed_precision='bf16'))\n"
             "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
             "ckpt = fsdp2nb.Checkpointer(ckpt_dir, memory_every=1).track(model=model, optimizer=opt)\n"
             "ids = torch.randint(0, 100, (2, 16), device=device)\n"
             "def full_state():\n"
             "    return {k: getattr(v, 'full_tensor', lambda v=v: v)().cpu() for k, v in model.state_dict().items()}\n")
    run = gpu_kernel.execute(setup, timeout=600)
    assert run.status == "ok", run.traceback_text
    run = gpu_kernel.execute(
        "%%fsdp2\nfor step in range(3):\n"
        "    model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad(); ckpt.maybe_save(step)\n"
        "ckpt.wait()\nat_2 = full_state()\ntorch.save(at_2, os.path.join(ckpt_dir, f'at-2-{rank}.pt'))", timeout=600)
    assert run.status == "ok", run.traceback_text
    assert gpu_kernel.execute("%fsdp2 restart").status == "ok"
    run = gpu_kernel.execute(setup, timeout=600)
    assert run.status == "ok" and "restored step 2 from memory" in run.stdout, run.traceback_text or run.stdout
    run = gpu_kernel.execute("%%fsdp2\nat_2 = torch.load(os.path.join(ckpt_dir, f'at-2-{rank}.pt'))\n"
                             "print('equal', all(torch.equal(t, at_2[k]) for k, t in full_state().items()))\n"
                             "ckpt.close()", timeout=600)
    assert every_rank_printed(gpu_kernel.num_gpus, "equal True") in run.stdout, run.stdout + run.traceback_text


def test_cuda_initialised_in_the_kernel_does_not_reach_the_ranks():
    # Ranks are fresh processes, not forks of the kernel: CUDA state in the kernel must not matter.
    kernel = Kernel()
    try:
        kernel.execute("%load_ext fsdp2nb")
        assert kernel.execute("import torch\nx = torch.ones(1, device='cuda')\nprint(x.item())").stdout == "1.0\n"
        run = kernel.execute("%%fsdp2 --gpus 1\ny = torch.ones(1, device=device) * 3\nprint(y.item(), device)")
        assert run.status == "ok", run.traceback_text
        assert run.stdout == "3.0 cuda:0\n"
    finally:
        kernel.stop()
