"""How `%fsdp2 stacks` reads: labelled by rank, a cell's frames from the cell on, fsdp2nb's own
threads in one line, a thread's start in threading.py left out, a rank that did not answer named."""

from fsdp2nb.frontend.profiles import describe_stacks
from fsdp2nb.wire.events import RankStacks, ThreadStack

LOOP = ("<frozen runpy>:198 in _run_module_as_main", "fsdp2nb/worker/rank.py:220 in serve")
START = ("threading.py:1002 in _bootstrap", "threading.py:1045 in _bootstrap_inner", "threading.py:982 in run")


def test_stacks_read_by_rank_from_the_cell_on():
    main = ThreadStack(name="MainThread", main=True, frames=(*LOOP, "In[4] line 2: dist.all_reduce(x)",
                                                             "torch/distributed/distributed_c10d.py:3252 in all_reduce"))
    loader = ThreadStack(name="loader", main=False, frames=(*START, "data.py:9 in fill", "threading.py:327 in wait"))
    sampler = ThreadStack(name="fsdp2nb-sampler", main=False, frames=(*START, "threading.py:331 in wait"))
    text = describe_stacks({0: RankStacks(rank=0, request_id=1, cell_id=3, threads=(main, loader, sampler))}, 2)
    assert text.splitlines() == [
        "[0] running a request",
        "[0]   thread MainThread (runs cells):",
        "[0]     ... 2 frames of the rank's request loop",
        "[0]     In[4] line 2: dist.all_reduce(x)",
        "[0]     torch/distributed/distributed_c10d.py:3252 in all_reduce",
        "[0]   thread loader:",
        "[0]     data.py:9 in fill",
        "[0]     threading.py:327 in wait",
        "[0]   thread fsdp2nb-sampler: threading.py:331 in wait",
        "[1] did not answer (its control thread is busy or the rank is gone)",
    ]
