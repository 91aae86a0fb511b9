"""Fixtures for tests over real hosts on one machine: network namespaces, and Ray across them.

Both are package-scoped: one Ray cluster (20-50 s to start on 2 cores) serves every Ray test here,
and it ends with this package, so its idle processes take no CPU from the tests after it. Both are
always cleaned up; each test that uses them skips, with the reason, where namespaces cannot be made
or Ray is absent.
"""

import importlib.util
import sys

import pytest

from tests.support.netns import TestHosts
from tests.support.ray_cluster import RayCluster


@pytest.fixture(scope="package")
def test_hosts():
    """Two network namespaces joined by a veth pair: 10.213.0.1 (host 0) and 10.213.0.2 (host 1)."""
    reason = TestHosts.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no test hosts: {reason}")
    with TestHosts(2) as hosts:
        yield hosts


@pytest.fixture(scope="package")
def ray_cluster(test_hosts):
    """A Ray head on host 0 and a worker node on host 1, both alive; drivers run in host 0."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed: pip install ray (or pip install 'fsdp2nb[ray]')")
    with RayCluster(test_hosts, python=sys.executable) as cluster:
        cluster.wait_until_nodes(len(test_hosts))
        yield cluster
