"""Pickles of plain values and tensors that load without running anyone's code.

A snapshot's small state (RNG streams, the optimizer's hyperparameters, a scheduler's state) is
written every step, and `torch.save` with its zip container cost a third of a small model's
snapshot. Here a tensor is pickled as a reference to its bytes, dtype and shape, and loading
builds only what pickle builds itself (dicts, lists, tuples, numbers, strings, bytes) plus those
tensors: any class the stream names is refused, as `torch.load(weights_only=True)` would.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

_TENSOR = "tensor"


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            cpu = obj.detach().cpu().contiguous()
            return (_TENSOR, str(cpu.dtype).removeprefix("torch."), tuple(cpu.shape),
                    cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, dtype, shape, raw = pid
        if kind != _TENSOR or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise pickle.UnpicklingError(f"not a tensor reference: {kind!r}, {dtype!r}")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is refused: only plain values and tensors load here")


def dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()
