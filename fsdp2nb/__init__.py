"""fsdp2nb: persistent FSDP2 ranks behind a %%fsdp2 cell magic.

`%load_ext fsdp2nb` registers the magics and imports no torch: the engine and checkpoint names
below (and `TrainerCallback`, `trainer_for`, for a Hugging Face Trainer; `hsdp_mesh`, HSDP's 2-D mesh)
are resolved on first use, so loading the extension costs milliseconds.
Every error fsdp2nb raises derives from `Fsdp2nbError` (fsdp2nb/errors.py); a cell whose ranks
raised raises `RankError`.
"""

from __future__ import annotations

import atexit
import importlib
from typing import Any

from fsdp2nb.errors import Fsdp2nbError, RankError, UsageMistake

__version__ = "0.1.0"  # pyproject.toml reads it from here
__all__ = [
    "Checkpointer",
    "FSDP2Engine",
    "FSDP2TrainerMixin",
    "Fsdp2nbError",
    "RankError",
    "TrainerCallback",
    "UsageMistake",
    "clip_grad_norm_",
    "evaluate",
    "export_hf",
    "generate",
    "hsdp_mesh",
    "load_ipython_extension",
    "load_model",
    "log",
    "plan_memory",
    "profile",
    "trainer_for",
    "unload_ipython_extension",
]

_LAZY_NAMES = {
    "FSDP2Engine": "fsdp2nb.engine",
    "load_model": "fsdp2nb.engine",
    "clip_grad_norm_": "fsdp2nb.engine",
    "generate": "fsdp2nb.engine",
    "evaluate": "fsdp2nb.engine",
    "hsdp_mesh": "fsdp2nb.engine",
    "Checkpointer": "fsdp2nb.checkpoint",
    "TrainerCallback": "fsdp2nb.engine.trainer_callback",
    "export_hf": "fsdp2nb.checkpoint.hf_export",
    "FSDP2TrainerMixin": "fsdp2nb.engine.hf_trainer",
    "trainer_for": "fsdp2nb.engine.hf_trainer",
    "log": "fsdp2nb.metrics",
    "profile": "fsdp2nb.worker.profiling",
    "plan_memory": "fsdp2nb.engine.memory_plan",
}
_session = None
_cells_ahead = None


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp2nb' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public API, the lazy names too, so tab completion offers them without importing torch
    (and not the module's own imports)."""
    return sorted([*__all__, "__version__"])


def load_ipython_extension(ipython) -> None:
    """Register %fsdp2 and %%fsdp2; loading twice keeps the one session."""
    global _session, _cells_ahead
    from fsdp2nb.frontend.cell_ahead import CellsAhead
    from fsdp2nb.frontend.magics import FSDP2Magics
    from fsdp2nb.frontend.session import NotebookSession

    if _session is None:
        _session = NotebookSession()
        atexit.register(_session.release)  # a kept pool is let go of, not ended
        _cells_ahead = CellsAhead(ipython, _session)
        _cells_ahead.listen()
    ipython.register_magics(FSDP2Magics(ipython, _session, _cells_ahead))
    _session.prepare_first_start()


def unload_ipython_extension(ipython) -> None:
    """Stop the pool (let go of a kept one); the magics stay registered but start a new pool on next use."""
    if _session is not None:
        _session.release()
