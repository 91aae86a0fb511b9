"""A rank's mistake while the others wait in a collective costs no state.

On 2 CPU ranks with a tiny model, its optimizer and a variable: a rank raising while the other
waits in all_reduce, a rank raising inside FSDP2's forward while the other waits in its
all-gather, the stop button while one rank sleeps and the other waits in all_reduce, a rank
still computing long after the other failed, and collectives that do not match. Each time the cell fails as a cell does, the blocked rank is
released, the process groups are re-formed in the same processes, and the variables, the
parameters and the optimizer state are bitwise the same; training then gives the losses of a
run that never failed.
"""

import pytest

from tests.support.training_cells import SETUP, losses

SNAPSHOT = """%%fsdp2
import os
def state_snapshot():
    params = [p.to_local().clone() for p in model.parameters()]
    moments = [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
               for s in optimizer.state.values() for v in s.values()]
    return params + moments
snapshot, pid = state_snapshot(), os.getpid()
ckpt.save(STEP)
ckpt.wait()
"""
UNCHANGED = """%%fsdp2
from torch.distributed.tensor import DTensor
sharded = all(isinstance(p, DTensor) for p in model.parameters())  # FSDP2 registers plain tensors while unsharded
now = state_snapshot()
print(keep_me, pid == os.getpid(), len(now) == len(snapshot) and all(a.equal(b) for a, b in zip(now, snapshot)),
      sharded)
"""
TRAIN = ("%%fsdp2\nfor step in range(10, 12):\n    loss = train_step(step)\n"
         "    if rank == 0: print(f'step {step} loss {loss:.6f}')")


@pytest.fixture(scope="module")
def trained(kernel, tmp_path_factory):
    root = tmp_path_factory.mktemp("failed_collectives")
    run = kernel.execute(f"model_dir = {str(root / 'model')!r}\nckpt_dir = {str(root / 'ckpt')!r}\n"
                         "%fsdp2 push model_dir ckpt_dir")
    assert run.status == "ok", run.stderr
    run = kernel.execute(SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute("%%fsdp2\nfor step in range(2):\n    train_step(step)\nckpt.save(2)\nckpt.wait()\n"
                         "keep_me = 'kept'")
    assert run.status == "ok", run.traceback_text
    return kernel


_saved_steps = iter(range(100, 200))


def _assert_state_kept(kernel, failing_cell: str, **execute) -> str:
    """Run `failing_cell` between a snapshot (and a checkpoint of the same state) and the check;
    the failed cell's traceback text."""
    assert kernel.execute(SNAPSHOT.replace("STEP", str(next(_saved_steps)))).status == "ok"
    if "when_printed" in execute:
        run = kernel.execute_and_interrupt(failing_cell, **execute)
    else:
        run = kernel.execute(failing_cell, timeout=120)
    assert run.status == "error"
    text = run.traceback_text
    assert "re-formed in place" in text and "restarted" not in text, text
    check = kernel.execute(UNCHANGED)
    assert check.stdout == "[all] kept True True True\n", check.traceback_text + check.stdout
    return text


def _assert_trains_as_if_nothing_failed(kernel) -> None:
    after = kernel.execute(TRAIN)
    assert kernel.execute("%fsdp2 load latest").status == "ok"  # the state before the failure
    reference = kernel.execute(TRAIN)
    assert losses(after.stdout) == losses(reference.stdout) and len(losses(after.stdout)) == 2, \
        after.traceback_text + reference.traceback_text


def test_a_rank_raising_while_the_other_waits_in_all_reduce(trained):
    text = _assert_state_kept(trained, "%%fsdp2\nt = torch.ones(3)\nif rank == 1:\n"
                                       "    raise ValueError('bad batch on rank 1')\ndist.all_reduce(t)")
    lines = text.splitlines()
    assert "[1] rank 1 raised ValueError" in lines[0]  # the root cause first
    assert "released rank(s) 0 from all_reduce" in text
    assert "rank 0 raised" not in text  # the released rank is one line, not a traceback
    _assert_trains_as_if_nothing_failed(trained)


def test_a_rank_raising_inside_fsdp_forward_while_the_other_waits_in_its_all_gather(trained):
    cell = ("%%fsdp2\nlayer = model.model.layers[1]\ndef fail_on_rank_1(module, args):\n"
            "    if rank == 1:\n        raise RuntimeError('out of memory on rank 1 (simulated)')\n"
            "hook = layer.register_forward_pre_hook(fail_on_rank_1)\n"
            "try:\n    train_step(5)\nfinally:\n    hook.remove()")
    text = _assert_state_kept(trained, cell)
    assert "[1] rank 1 raised RuntimeError" in text.splitlines()[0]
    assert "released rank(s) 0" in text
    _assert_trains_as_if_nothing_failed(trained)


def test_the_stop_button_with_a_rank_in_all_reduce(trained):
    cell = ("%%fsdp2\nimport time\nt = torch.ones(3)\nprint('waiting', flush=True)\nif rank == 0:\n"
            "    time.sleep(60)\ndist.all_reduce(t)")
    text = _assert_state_kept(trained, cell, when_printed="waiting")
    assert "rank 0 raised KeyboardInterrupt" in text and "released rank(s) 1 from all_reduce" in text
    _assert_trains_as_if_nothing_failed(trained)


def test_a_rank_still_computing_when_another_fails_is_interrupted_and_the_pool_keeps_its_state(trained):
    """No collective to release: the computing rank is interrupted, as a plain cell would be, and
    nothing is restarted however long its work would have taken."""
    assert trained.execute(SNAPSHOT.replace("STEP", str(next(_saved_steps)))).status == "ok"
    cell = ("%%fsdp2\nimport time\nif rank == 0:\n    raise ValueError('bad batch on rank 0')\n"
            "started = time.monotonic()\nwhile time.monotonic() - started < 60:\n    sum(range(1000))\n"
            "dist.all_reduce(torch.ones(1))")
    run = trained.execute(cell, timeout=120)
    text = run.traceback_text
    assert run.status == "error" and "[0] rank 0 raised ValueError" in text.splitlines()[0], text
    # The interrupt is not a second root cause: one line says where the rank was.
    assert "KeyboardInterrupt" not in text and "restarted" not in text, text
    assert "interrupted rank(s) 1: rank 0 failed while they went on (rank 1 at In[" in text, text
    check = trained.execute(UNCHANGED)
    assert check.stdout == "[all] kept True True True\n", check.traceback_text + check.stdout


def test_the_first_stop_press_after_the_automatic_interrupt_interrupts_again(trained):
    """A rank that catches the interrupt sent after another rank failed goes on; the user's first
    press must interrupt it again, as a first press does, not count as a second, which gives up
    on the ranks and restarts the pool."""
    assert trained.execute(SNAPSHOT.replace("STEP", str(next(_saved_steps)))).status == "ok"
    cell = ("%%fsdp2\nimport time\nif rank == 0:\n    raise ValueError('bad batch on rank 0')\n"
            "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
            "    print('caught the interrupt', flush=True)\n    time.sleep(60)")
    run = trained.execute_and_interrupt(cell, when_printed="caught the interrupt", timeout=120)
    text = run.traceback_text
    assert run.status == "error" and "[0] rank 0 raised ValueError" in text.splitlines()[0], text
    assert "[1] caught the interrupt" in run.stdout, run.stdout
    assert "restarted" not in text + run.stderr and "KeyboardInterrupt" in text, text
    check = trained.execute(UNCHANGED)
    assert check.stdout == "[all] kept True True True\n", check.traceback_text + check.stdout


def test_collectives_that_do_not_match_are_released(trained):
    cell = "%%fsdp2\nt = torch.ones(3)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.barrier()"
    text = _assert_state_kept(trained, cell)
    assert "collectives did not match: rank 0 in all_reduce" in text and "rank 1 in barrier" in text


def test_a_user_error_that_mentions_a_timeout_is_a_user_error(trained):
    run = trained.execute("%%fsdp2\nraise RuntimeError('DataLoader worker timed out after 5 seconds')")
    assert run.status == "error" and "timed out after 5 seconds" in run.traceback_text
    assert "collective" not in run.traceback_text and "restart" not in run.traceback_text
    after = trained.execute("%%fsdp2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(keep_me, t.item())")
    assert after.stdout == "[all] kept 2.0\n", after.traceback_text


def test_a_group_made_with_plain_gloo_is_named_as_one_that_cannot_be_re_formed(trained):
    made = trained.execute("%%fsdp2\nplain = dist.new_group(backend='gloo')")
    assert made.status == "ok", made.traceback_text
    run = trained.execute("%%fsdp2\nt = torch.ones(1)\nif rank == 1:\n    raise ValueError('bad')\ndist.all_reduce(t)")
    assert run.status == "error" and "re-formed in place" in run.traceback_text
    assert "(gloo) were made with another backend and cannot be re-formed" in run.stderr, run.stderr
    after = trained.execute("%%fsdp2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(keep_me, t.item())")
    assert after.stdout == "[all] kept 2.0\n", after.traceback_text


def test_a_2d_meshs_groups_are_re_formed_after_a_rank_raising_while_others_wait(kernel):
    """HSDP's mesh on 4 ranks (2 x 2): its row and column groups are made with the pool's
    default backend, so they are released and re-formed like the world group. Rank 3 raises;
    rank 2 waits for it in a "shard" all_reduce, ranks 0 and 1 then in "replicate" ones."""
    started = kernel.execute("%fsdp2 restart --cpu 4", timeout=300)
    assert started.status == "ok", started.traceback_text + started.stderr
    # The mesh code imported first: a rank still importing it half a second after the others
    # raised (4 ranks on 2 busy cores) would be released as one left waiting, a second line.
    warmed = kernel.execute("%%fsdp2\nimport fsdp2nb\nfsdp2nb.hsdp_mesh\nimport fsdp2nb.engine.mesh")
    assert warmed.status == "ok", warmed.traceback_text
    mistake = kernel.execute("%%fsdp2\nfsdp2nb.hsdp_mesh(replicate=3)")
    lines = mistake.traceback_text.strip().splitlines()
    assert len(lines) == 1 and "[all] ranks 0, 1, 2, 3 raised InvalidMesh" in lines[0], lines  # no traceback
    assert "replicate=3 does not divide the 4 ranks; choose one of (1, 2, 4)" in lines[0], lines
    made = kernel.execute("%%fsdp2\nhsdp = fsdp2nb.hsdp_mesh(replicate=2)\n"
                          "rows, columns = hsdp.get_group('shard'), hsdp.get_group('replicate')\n"
                          "print(dist.get_backend(rows), dist.get_backend(columns))")
    assert made.stdout == "[all] reformable_gloo reformable_gloo\n", made.traceback_text + made.stdout
    failed = kernel.execute("%%fsdp2\nt = torch.ones(1)\nif rank == 3:\n    raise ValueError('bad batch on rank 3')\n"
                            "dist.all_reduce(t, group=rows)\ndist.all_reduce(t, group=columns)", timeout=120)
    text = failed.traceback_text
    assert failed.status == "error" and "[3] rank 3 raised ValueError" in text.splitlines()[0], text
    assert "re-formed in place" in text and "released rank(s)" in text and "restarted" not in text, text
    after = kernel.execute("%%fsdp2\nt = torch.ones(1)\ndist.all_reduce(t, group=rows)\n"
                           "dist.all_reduce(t, group=columns)\ndist.all_reduce(t)\n"
                           "print(t.item(), hsdp.get_group('shard') is rows)")
    assert after.stdout == "[all] 16.0 True\n", after.traceback_text + after.stdout  # 1 -> 2 -> 4 -> 16
