"""Helpers for tests, benchmarks and the demo: tiny models that need no network."""

from fsdp2nb.testing.tiny_models import TINY_FAMILIES, make_tiny_model, save_tiny_checkpoint

__all__ = ["TINY_FAMILIES", "make_tiny_model", "save_tiny_checkpoint"]
