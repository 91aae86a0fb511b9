"""Where a rank's main thread is, read from a stack sample taken by another thread."""

import linecache
import threading

from fsdp2nb.worker.activity import main_thread_activity

_C10D = "/site-packages/torch/distributed/distributed_c10d.py"


def _sample_from_another_thread() -> tuple[str, str | None]:
    main_id = threading.get_ident()
    seen = []
    sampler = threading.Thread(target=lambda: seen.append(main_thread_activity(main_id)))
    sampler.start()
    sampler.join()
    return seen[0]


def _define(source: str, filename: str, namespace: dict) -> None:
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)


def test_names_the_cell_line_and_the_collective():
    namespace = {"sample": _sample_from_another_thread}
    # A collective as torch.distributed defines it: a decorator's wrapper around the public name.
    _define("def wrapper(f):\n    return f()\ndef all_reduce():\n    return wrapper(sample)\n", _C10D, namespace)
    cell = "<ipython-input-7-0123abcd>"
    _define("x = 1\nresult = all_reduce()\n", cell, namespace)
    where, collective = namespace["result"]
    assert where == "In[7] line 2: result = all_reduce()"
    assert collective == "all_reduce"


def test_outside_any_cell_or_collective_says_nothing():
    assert _sample_from_another_thread() == ("", None)
