"""A failure's kind comes from the exception's type and where it was raised, not its words."""

import os

import torch.distributed as dist

from fsdp2nb.worker.error_kinds import error_kind


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as error:  # whatever it raised is the subject
        return error
    raise AssertionError("nothing was raised")


def _raise(error):
    raise error


def test_a_user_error_that_mentions_a_timeout_is_raised():
    error = _raised(lambda: _raise(RuntimeError("DataLoader worker timed out after 5 seconds")))
    assert error_kind(error, released=False) == "raised"
    assert error_kind(error, released=True) == "raised"


def test_torch_distributed_errors_are_collective_failures():
    error = _raised(lambda: _raise(dist.DistBackendError("Connection closed by peer")))
    assert error_kind(error, released=False) == "collective"
    assert error_kind(error, released=True) == "released"


def test_a_runtime_error_raised_inside_torch_distributed_is_a_collective_failure():
    # gloo's timeouts and lost peers: a plain RuntimeError, raised by torch.distributed's code.
    inside = compile("raise RuntimeError('Timed out waiting for recv')",
                     os.path.join(os.path.dirname(dist.__file__), "distributed_c10d.py"), "exec")
    error = _raised(lambda: exec(inside))
    assert error_kind(error, released=False) == "collective"
    outside = _raised(lambda: _raise(RuntimeError("Timed out waiting for recv")))
    assert error_kind(outside, released=False) == "raised"


def _reraise_as_user_error(error):
    try:
        raise error
    except BaseException as cause:
        raise ValueError("my loop failed") from cause


def test_a_collective_failure_kept_as_a_cause_counts():
    cause = _raised(lambda: _raise(dist.DistNetworkError("peer gone")))
    error = _raised(lambda: _reraise_as_user_error(cause))
    assert error_kind(error, released=False) == "collective"


def test_interrupts_are_their_own_kind_unless_a_released_collective_unwinds():
    assert error_kind(_raised(lambda: _raise(KeyboardInterrupt())), released=False) == "interrupted"
    cause = _raised(lambda: _raise(dist.DistBackendError("closed")))
    interrupt = _raised(lambda: _interrupt_during(cause))
    assert error_kind(interrupt, released=True) == "released"
    assert error_kind(interrupt, released=False) == "interrupted"


def _interrupt_during(error):
    try:
        raise error
    except BaseException:
        raise KeyboardInterrupt from None
