import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel


def _kernel_with_a_pool():
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    run = k.execute("%fsdp2 start --cpu 2")
    assert run.status == "ok", run.traceback_text
    yield k
    k.stop()


@pytest.fixture(scope="package")
def shared_kernel():
    """One kernel and pool for the modules that set `SHARES_THE_POOL = True`: their tests define
    names and run, fail or interrupt cells, but never restart, stop or kill the pool, track no
    checkpointer, and assert nothing about what another module may have defined. Package-scoped:
    it ends with tests/kernel, so its idle ranks take no CPU from the tests after it."""
    yield from _kernel_with_a_pool()


@pytest.fixture(scope="module")
def kernel(request):
    """A real ipykernel with the extension loaded and a 2-rank CPU pool running: the module's own,
    or the shared one where the module sets `SHARES_THE_POOL = True`."""
    if getattr(request.module, "SHARES_THE_POOL", False):
        yield request.getfixturevalue("shared_kernel")
        return
    yield from _kernel_with_a_pool()


@pytest.fixture
def assert_pool_usable(kernel):
    """Call after a failure: asserts that a plain cell runs on every rank of `kernel` again."""

    def check() -> None:
        run = kernel.execute("%%fsdp2\nprint('usable')")
        assert run.stdout == "[all] usable\n", run.traceback_text or run.stderr

    return check
