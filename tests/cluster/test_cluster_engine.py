"""The engine against a 3-node cluster by ``--kv-connector``: ``kvstore://a,b,c`` (static,
replicas=2) and ``etcd://host:port/CLUSTER`` (membership). A second engine hits what the
first stored, even with one node killed, and its output equals the no-cache reference."""

from __future__ import annotations

import pytest
from cluster.cluster_etcd import until_view
from connutil import random_prompt, run_fresh, store_cold

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    """The suite's tiny model with grouped KV heads (tests/conftest.py's ``tiny_model_dir``)."""
    return tiny_model_dir("llama-gqa4")


async def _store_then_hit(model_dir: str, url: str, prompt: list[int], between=None) -> int:
    """``prompt`` stored cold through ``url`` (its output the reference's), ``between()``, then
    run on a fresh engine: its output the reference's again; the tokens it had cached."""
    ref, _ = await store_cold(model_dir, url, prompt)
    if between is not None:
        between()
    toks, cached = await run_fresh(model_dir, url, prompt)
    assert toks == ref
    return cached


async def test_cluster_engine_kvstore_url_survives_a_killed_node(model_dir, start_daemon):
    ds = [start_daemon(use_disk=False) for _ in range(3)]
    url = "kvstore://" + ",".join(d.addr for d in ds) + "?replicas=2&policy=always&lookup_deadline_s=5"
    cached = await _store_then_hit(model_dir, url, random_prompt(150, 3), between=ds[0].kill9)
    assert cached == 144  # every block had a copy on a surviving node


async def test_cluster_engine_etcd_url(model_dir, start_daemon, etcd):
    join = etcd.url("engine")
    ds = [start_daemon(use_disk=False, cluster={"join": join, "lease_ttl_s": 2}) for _ in range(3)]
    from kvstore.client.etcd_membership import EtcdMembership

    m = EtcdMembership(join)
    await m.start()
    await until_view(m, "every node a member", [d.addr for d in ds], deadline_s=15.0)
    await m.close()
    url = f"{join}?replicas=2&policy=always&lookup_deadline_s=5"
    assert await _store_then_hit(model_dir, url, random_prompt(150, 4)) == 144
