"""Pickles of plain values and tensors that load without running anyone's code.

A snapshot's small state (RNG streams, the optimizer's hyperparameters, a scheduler's state) is
written every step, and `torch.save` with its zip container cost a third of a small model's
snapshot. Here a tensor is pickled as a reference to its bytes, dtype and shape, and loading
builds only what pickle builds itself (dicts, lists, tuples, sets, numbers, strings, bytes) plus
a few values named by reference: tensors, `torch.Size`, dtypes, `OrderedDict`s (a module's
`state_dict()`), numpy scalars and arrays of plain dtypes. Any class the stream names is refused,
as `torch.load(weights_only=True)` would; and `dumps` refuses, before writing anything, a value
that `loads` could not read back.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

from fsdp2nb.errors import Fsdp2nbError

_TENSOR, _SIZE, _DTYPE, _ORDERED_DICT, _NUMPY = "tensor", "size", "dtype", "ordered_dict", "numpy"


class Unkeepable(Fsdp2nbError, TypeError):
    """A value of a type the snapshot's small state cannot hold; the message names it."""


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            cpu = obj.detach().cpu().contiguous()
            return (_TENSOR, _dtype_name(cpu.dtype), tuple(cpu.shape),
                    cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
        if isinstance(obj, torch.Size):
            return (_SIZE, tuple(obj))
        if isinstance(obj, torch.dtype):
            return (_DTYPE, _dtype_name(obj))
        if type(obj) is collections.OrderedDict:
            return (_ORDERED_DICT, list(obj.items()))
        return _numpy_reference(obj)

    def reducer_override(self, obj: Any) -> Any:
        """Reached by every value pickle does not build itself and no reference above covers."""
        raise Unkeepable(f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be kept in a snapshot's state "
                         "(plain values, tensors, dtypes, OrderedDicts and numpy values only)")


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"not a reference this module writes: {pid!r}")
        kind, *fields = pid
        if kind == _TENSOR:
            dtype, shape, raw = fields
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_dtype(dtype)).reshape(shape) \
                if raw else torch.empty(shape, dtype=_dtype(dtype))
        if kind == _SIZE:
            return torch.Size(fields[0])
        if kind == _DTYPE:
            return _dtype(fields[0])
        if kind == _ORDERED_DICT:
            return collections.OrderedDict(fields[0])
        if kind == _NUMPY:
            return _numpy_value(*fields)
        raise pickle.UnpicklingError(f"not a reference this module writes: {kind!r}")

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is refused: only plain values and tensors load here")


def dumps(value: Any) -> bytes:
    """`value` pickled; raises `Unkeepable` for anything `loads` would refuse."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a torch dtype: {name!r}")
    return dtype


def _numpy_reference(obj: Any) -> tuple | None:
    """A numpy scalar or array as its dtype, shape and bytes; None for anything else."""
    if type(obj).__module__ != "numpy":
        return None
    import numpy

    if not isinstance(obj, numpy.ndarray | numpy.generic):
        return None
    array = numpy.asarray(obj)
    if array.dtype.hasobject:
        return None  # refused by reducer_override: objects inside
    return (_NUMPY, array.dtype.str, array.shape, isinstance(obj, numpy.generic), array.tobytes())


def _numpy_value(dtype: Any, shape: Any, scalar: Any, raw: Any) -> Any:
    import numpy

    kind = numpy.dtype(dtype) if isinstance(dtype, str) else None
    if kind is None or kind.hasobject:
        raise pickle.UnpicklingError(f"not a plain numpy dtype: {dtype!r}")
    array = numpy.frombuffer(raw, dtype=kind).reshape(shape).copy()
    return array[()] if scalar else array
