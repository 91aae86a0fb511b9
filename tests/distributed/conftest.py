import pytest

from fsdp2nb.pool.pool import WorkerPool
from fsdp2nb.pool.spec import PoolSpec


@pytest.fixture(scope="module")
def pool():
    """A started 2-rank CPU pool, shared by the tests of one module."""
    pool = WorkerPool(PoolSpec(devices=("cpu", "cpu")))
    pool.start()
    yield pool
    pool.stop()
    pool.stop()  # safe to call twice
