"""How each notebook tool for distributed PyTorch is driven, the way its own docs show.

Every driver offers the same few steps, each as the cells a user would type into a notebook
(run through a real kernel by `benchmarks/peers.py`):
- `start_cells`: from a fresh kernel to the first cell done with torch imported and a gloo
  process group formed on every rank;
- `on_ranks(code)`: a cell that runs `code` on every rank (with `rank` defined, the group formed);
- `empty_cell`: the tool's empty cell, as small as the tool allows;
- `crash_cell`: a cell whose rank 1 dies at once while the others sleep;
- `recover_cells`: what its docs say to do after a rank died, before `start_cells` work again.
A tool with no persistent ranks (accelerate's `notebook_launcher`) starts them in every cell.
"""

from __future__ import annotations

import socket
import sys
import textwrap
from dataclasses import dataclass

SLEEPING_RANKS = "import os, time\nif rank == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(60)\n"
"""Rank 1 dies at once; the others would sleep a minute, unless the tool notices and stops them."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Driver:
    """One tool's cells; see the module docstring."""

    name: str
    package: str
    """The PyPI name; the driver is skipped (reported as failed) when it does not import."""
    module: str

    def start_cells(self, num_ranks: int) -> list[str]:
        raise NotImplementedError

    def on_ranks(self, code: str) -> str:
        raise NotImplementedError

    @property
    def empty_cell(self) -> str:
        return self.on_ranks("pass")

    @property
    def crash_cell(self) -> str:
        return self.on_ranks(SLEEPING_RANKS)

    def recover_cells(self, num_ranks: int) -> list[str]:
        return []

    def back_cells(self, num_ranks: int) -> list[str]:
        """After a rank died: the tool's recovery, then the cells that form the group again."""
        return self.recover_cells(num_ranks) + self.start_cells(num_ranks)

    def stop_cells(self) -> list[str]:
        return []

    shows_rank_output = True
    """Whether what ranks print reaches the notebook."""
    persistent = True
    """Whether ranks (and their variables) outlive a cell."""


class Fsdp2nb(Driver):
    def start_cells(self, num_ranks: int) -> list[str]:
        return ["%load_ext fsdp2nb", f"%fsdp2 start --cpu {num_ranks}", self.on_ranks(FORMED)]

    def on_ranks(self, code: str) -> str:
        return "%%fsdp2\n" + code

    def back_cells(self, num_ranks: int) -> list[str]:
        return []  # the pool restarts itself once a rank has died

    def stop_cells(self) -> list[str]:
        return ["%fsdp2 stop"]


FORMED = "import torch, torch.distributed as dist\nassert dist.is_initialized()\n"


class Ipyparallel(Driver):
    """A `Cluster` of engines, `%%px` on all of them; each engine joins the group in a `%%px` cell
    with its rank scattered to it, as ipyparallel's torch examples do."""

    def start_cells(self, num_ranks: int) -> list[str]:
        port = free_port()
        return [
            "import ipyparallel as ipp\n"
            f"cluster = ipp.Cluster(n={num_ranks})\n"
            "rc = cluster.start_and_connect_sync()\n"
            "rc.activate()  # %%px on all engines, blocking (a new cluster's client must be activated)\n"
            f"rc[:].scatter('rank', list(range({num_ranks})), flatten=True, block=True)",
            self.on_ranks("import torch, torch.distributed as dist\n"
                          f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=rank, "
                          f"world_size={num_ranks})\n"),
        ]

    def on_ranks(self, code: str) -> str:
        return "%%px\n" + code

    def recover_cells(self, num_ranks: int) -> list[str]:
        return self.stop_cells()

    def stop_cells(self) -> list[str]:
        return ["cluster.stop_cluster_sync()"]


class Nbdistributed(Driver):
    """`%dist_init` starts workers that import torch and form the group themselves."""

    def start_cells(self, num_ranks: int) -> list[str]:
        return ["%load_ext nbdistributed", f"%dist_init -n {num_ranks}", self.on_ranks(FORMED)]

    def on_ranks(self, code: str) -> str:
        return "%%distributed\n" + code

    def recover_cells(self, num_ranks: int) -> list[str]:
        return ["%dist_shutdown"]

    def stop_cells(self) -> list[str]:
        return ["%dist_shutdown"]


class JupyterDistributed(Driver):
    """Its server extension swaps the kernel for a proxy over N rank kernels; `kernel_argv` starts
    that proxy as the extension does. Every cell runs on every rank; RANK etc. are set."""

    def start_cells(self, num_ranks: int) -> list[str]:
        return [self.on_ranks("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                              "rank = dist.get_rank()\n")]

    def on_ranks(self, code: str) -> str:
        return code

    def kernel_argv(self) -> list[str]:
        return [sys.executable, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"]


MONARCH_ACTOR = textwrap.dedent("""
    from monarch.actor import Actor, endpoint, this_host
    from monarch.spmd import setup_torch_elastic_env_async

    class Rank(Actor):
        def __init__(self):
            self.namespace = {}

        @endpoint
        def noop(self):
            pass

        @endpoint
        def run(self, code):
            exec(code, self.namespace)

    procs = this_host().spawn_procs(per_host={"procs": NUM_RANKS})
    await setup_torch_elastic_env_async(procs)
    ranks = procs.spawn("ranks", Rank)
""")


class Monarch(Driver):
    """Actors on a proc mesh, driven by explicit endpoint calls, awaited as Monarch asks inside a
    running event loop: `noop` is the empty call, `run` executes a cell's code in the actor (a
    user would write it as an endpoint)."""

    def start_cells(self, num_ranks: int) -> list[str]:
        return [MONARCH_ACTOR.replace("NUM_RANKS", str(num_ranks)),
                self.on_ranks("import os, torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                              "rank = dist.get_rank()\n")]

    def on_ranks(self, code: str) -> str:
        return f"await ranks.run.call({code!r})"

    @property
    def empty_cell(self) -> str:
        return "await ranks.noop.call()"

    def recover_cells(self, num_ranks: int) -> list[str]:
        return []  # a mesh with a dead proc is not used again: start_cells spawn a new one

    def stop_cells(self) -> list[str]:
        return ["await procs.stop()"]


ACCELERATE_RUN = textwrap.dedent("""
    from accelerate import notebook_launcher

    def on_every_rank(code):
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        exec(code, {"rank": accelerator.process_index, "accelerator": accelerator})
""")


class Accelerate(Driver):
    """`notebook_launcher` forks fresh processes in every call: each cell starts its ranks, forms
    the group (`Accelerator()`), runs and ends. A free port per call keeps calls independent."""

    persistent = False

    def back_cells(self, num_ranks: int) -> list[str]:
        return []  # the next call forks new ranks

    def start_cells(self, num_ranks: int) -> list[str]:
        return [ACCELERATE_RUN + f"NUM_RANKS = {num_ranks}\n", self.on_ranks(FORMED)]

    def on_ranks(self, code: str) -> str:
        return f"notebook_launcher(on_every_rank, args=({code!r},), num_processes=NUM_RANKS, use_port=str({free_port()}))"


DRIVERS = (
    Fsdp2nb("fsdp2nb", "fsdp2nb", "fsdp2nb"),
    Ipyparallel("ipyparallel", "ipyparallel", "ipyparallel"),
    JupyterDistributed("jupyter-distributed", "jupyter-distributed", "jupyter_distributed"),
    Nbdistributed("nbdistributed", "nbdistributed", "nbdistributed"),
    Accelerate("accelerate", "accelerate", "accelerate"),
    Monarch("Monarch", "torchmonarch", "monarch.actor"),
)
