"""Run a function on N CPU ranks joined by gloo, and collect what each rank returns.

`fn` must be importable (a module-level function of a test module): ranks are new processes that
ran no test code, forked from a fork server that imported torch and transformers once for the whole
session (PRELOAD), so that a call does not pay those imports on every rank (seconds each). The fork
server keeps the environment of the first call: `fn` sets what it needs in os.environ itself. Each
rank gets RANK/WORLD_SIZE/LOCAL_RANK set and an initialised process group; its return value must be
picklable. An exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers")
"""What the fork server imports before it forks any rank (a module that fails to import is skipped)."""


def _rank_main(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple, kwargs: dict) -> None:
    import torch.distributed as dist

    _set_rank_environment(rank, world_size)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        outcome = ("ok", fn(*args, **kwargs))
    except BaseException:  # report every failure, including KeyboardInterrupt and SystemExit
        outcome = ("error", f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)
    _exit_without_finalizing()


def _set_rank_environment(rank: int, world_size: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
    )


def _exit_without_finalizing() -> None:
    """End the rank process here, as the pool's ranks end, without Python's shutdown.

    A gloo worker thread releases a finished collective's tensors after the caller's wait has
    returned, and that release takes the GIL. If the interpreter is finalizing by then, CPython
    ends the thread with pthread_exit inside a C++ destructor, and the process dies of SIGABRT
    ("terminate called without an active exception"). destroy_process_group() does not join those
    threads while a DeviceMesh still holds the group, so the rank leaves with os._exit instead.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fork_server_context() -> mp.context.ForkServerContext:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    return context


def run_ranks(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results in rank order."""
    _fork_server_context()
    with tempfile.TemporaryDirectory(prefix="fsdp2nb-ranks-") as workdir:
        mp.start_processes(
            _rank_main, args=(fn, world_size, workdir, args, kwargs), nprocs=world_size,
            join=True, start_method="forkserver",
        )
        outcomes = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result-{rank}.pkl"), "rb") as f:
                outcomes.append(pickle.load(f))
    errors = [detail for status, detail in outcomes if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in outcomes]


def start_ranks(fn: Callable, world_size: int, *args: Any) -> list[mp.Process]:
    """Start `fn(*args)` on `world_size` ranks and return their processes at once, for a test in which
    a rank is meant to die (run_ranks takes a dead rank for a failure). Each rank has RANK and the
    rest set, but no process group: `fn` makes its own. The caller joins or kills the processes."""
    context = _fork_server_context()
    processes = [context.Process(target=_started_rank, args=(rank, world_size, fn, args)) for rank in range(world_size)]
    for process in processes:
        process.start()
    return processes


def _started_rank(rank: int, world_size: int, fn: Callable, args: tuple) -> None:
    _set_rank_environment(rank, world_size)
    fn(*args)
