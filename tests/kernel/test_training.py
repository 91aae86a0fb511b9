"""The engine and the checkpointer driven from notebook cells, as a user would.

Loads a tiny Llama-style safetensors checkpoint on 2 CPU ranks through `fsdp2nb.load_model`,
trains, saves with `%fsdp2 save`, resumes with `%fsdp2 load`, takes a save requested from the
kernel while a training cell runs, and resumes after a pool restart.
"""

import re

import pytest

from tests.support.training_cells import SETUP, losses


@pytest.fixture(scope="module")
def trained(kernel, tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    run = kernel.execute(f"model_dir = {str(root / 'model')!r}\nckpt_dir = {str(root / 'ckpt')!r}\n"
                         "%fsdp2 push model_dir ckpt_dir")
    assert run.status == "ok", run.stderr
    run = kernel.execute(SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute("%%fsdp2\nfor step in range(3):\n    loss = train_step(step)\n"
                         "    if rank == 0: print(f'step {step} loss {loss:.6f}')")
    assert run.status == "ok", run.traceback_text
    return kernel


def test_model_is_sharded_by_the_engine(trained):
    run = trained.execute("%%fsdp2\nfrom torch.distributed.tensor import DTensor\n"
                          "print(all(isinstance(p, DTensor) for p in model.parameters()), tokenizer is not None)")
    assert run.stdout == "[all] True True\n"


def test_save_and_load_magics_resume_exactly(trained):
    saved = trained.execute("%fsdp2 save 3")
    assert saved.status == "ok", saved.traceback_text
    assert re.search(r"saved step 3 in \S+", saved.stdout)
    code = ("%%fsdp2\nfor step in range(3, 5):\n    loss = train_step(step)\n"
            "    if rank == 0: print(f'step {step} loss {loss:.6f}')")
    first = trained.execute(code)
    loaded = trained.execute("%fsdp2 load 3")
    assert loaded.status == "ok" and "loaded step 3" in loaded.stdout, loaded.traceback_text
    second = trained.execute(code)
    assert losses(first.stdout) == losses(second.stdout) and len(losses(first.stdout)) == 2


@pytest.mark.timeout(900)  # three steps that each had 300 s as tests of their own
def test_a_save_requested_mid_cell_resumes_after_a_restart_and_stopping_lets_a_save_finish(trained):
    """One scenario, each step on the state the one before left: a save requested from the kernel
    while a cell trains, a pool restart that resumes from it, then a stop during an async save."""
    step = _save_requested_while_a_cell_runs_happens_at_one_step_on_all_ranks(trained)
    _resume_after_pool_restart(trained, step)
    _stopping_the_pool_lets_an_async_save_finish(trained)


def _save_requested_while_a_cell_runs_happens_at_one_step_on_all_ranks(trained) -> int:
    request = trained.execute("import threading, fsdp2nb\n"
                              "threading.Timer(1.0, fsdp2nb._session.pool.request_save).start()")
    assert request.status == "ok"
    run = trained.execute("%%fsdp2\nimport time\nsaved_at = None\n"
                          "for step in range(10, 100_000):\n    train_step(step)\n"
                          "    if ckpt.maybe_save(step):\n        saved_at = step\n        break\n"
                          "ckpt.wait()\nprint('saved at', saved_at)", timeout=200)
    assert run.status == "ok", run.traceback_text
    match = re.fullmatch(r"\[all\] saved at (\d+)\n", run.stdout)
    assert match, run.stdout
    return int(match.group(1))


def _resume_after_pool_restart(trained, step: int) -> None:
    assert trained.execute("%fsdp2 restart").status == "ok"
    assert trained.execute("%fsdp2 push model_dir ckpt_dir").status == "ok"
    run = trained.execute(SETUP.replace("if rank == 0:\n    save_tiny_checkpoint(model_dir, \"llama\")\n", ""),
                          timeout=300)
    assert run.status == "ok", run.traceback_text
    run = trained.execute("%%fsdp2\nprint('resumed at', ckpt.load('latest'))")
    assert run.stdout == f"[all] resumed at {step}\n", run.traceback_text


def _stopping_the_pool_lets_an_async_save_finish(trained) -> None:
    run = trained.execute("%%fsdp2\nckpt.save(5000)  # asynchronous: returns while files are written\n"
                          "print(ckpt.status().saving_step is not None or ckpt.latest() == 5000)")
    assert run.status == "ok", run.traceback_text
    assert trained.execute("%fsdp2 stop").stdout == "pool stopped\n"
    run = trained.execute("import os\nprint(open(os.path.join(ckpt_dir, 'LATEST')).read().strip(),\n"
                          "      os.path.exists(os.path.join(ckpt_dir, 'step-005000', 'fsdp2nb-checkpoint.json')))")
    assert run.stdout.split() in (["5000", "True"], ["step-005000", "True"]), run.stdout
