"""Cluster fixtures: etcd on loopback, and hosts in network namespaces (root only)."""

from __future__ import annotations

import pytest
from cluster.cluster_etcd import Etcd, etcd_missing


@pytest.fixture
def etcd(tmp_path):
    """A fresh etcd on loopback; skipped with a reason when etcd is not installed."""
    if etcd_missing():
        pytest.skip(etcd_missing())
    e = Etcd(tmp_path)
    e.start()
    yield e
    e.stop()


@pytest.fixture
def hosts(tmp_path):
    """A :class:`Cluster` of namespaced hosts; skipped with the reason when namespaces cannot
    be made (not root). Everything is torn down afterwards."""
    from cluster.cluster_hosts import Cluster
    from cluster.cluster_netns import cannot_make_namespaces

    why = cannot_make_namespaces()
    if why:
        pytest.skip(why)
    c = Cluster(tmp_path)
    yield c
    c.teardown()
