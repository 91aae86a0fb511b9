import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel


@pytest.fixture(scope="module")
def kernel():
    """A real ipykernel with the extension loaded and a 2-rank CPU pool running."""
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    run = k.execute("%fsdp2 start --cpu 2")
    assert run.status == "ok", run.traceback_text
    yield k
    k.stop()


@pytest.fixture
def assert_pool_usable(kernel):
    """Call after a failure: asserts that a plain cell runs on every rank of `kernel` again."""

    def check() -> None:
        run = kernel.execute("%%fsdp2\nprint('usable')")
        assert run.stdout == "[all] usable\n", run.traceback_text or run.stderr

    return check
