"""Helpers that tests, benchmarks and the demo share.

- `tiny_models`: tiny checkpoints that need no network;
- `gloo_harness`: run a function on N CPU ranks joined by gloo;
- `kernel_client`: drive a real ipykernel as a notebook front end does.
"""

from fsdp2nb.testing.tiny_models import TINY_FAMILIES, make_tiny_model, save_tiny_checkpoint

__all__ = ["TINY_FAMILIES", "make_tiny_model", "save_tiny_checkpoint"]
