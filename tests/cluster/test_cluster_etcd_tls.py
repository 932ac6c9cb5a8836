"""Membership against an etcd that requires a client certificate (TLS, ``--client-cert-auth``)
and a user: daemons register with the ``cluster.etcd_*`` keys and a watcher with the same
security sees them; without the certificate or with a wrong password nothing is seen."""

from __future__ import annotations

import time

import pytest
from cluster.cluster_etcd import Etcd, etcd_missing
from cluster.etcd_tls import make_certs, openssl_missing

from kvstore.client.etcd import EtcdClient, b64, prefix_end
from kvstore.client.etcd_membership import EtcdMembership
from kvstore.client.etcd_security import EtcdSecurity


@pytest.fixture
def tls_etcd(tmp_path):
    why = etcd_missing() or openssl_missing()
    if why:
        pytest.skip(why)
    files = make_certs(tmp_path / "certs")
    e = Etcd(tmp_path, tls=files)
    e.start()
    yield e, files
    e.stop()


async def _enable_auth(e: Etcd, sec: EtcdSecurity, password: str) -> None:
    """A root user (etcd needs one to turn auth on) and user ``kv`` allowed /tierkv/ only."""
    c = EtcdClient((e.endpoint,), 5.0, security=sec)
    await c.call("auth/user/add", {"name": "root", "password": "root-pass-0001"})
    await c.call("auth/user/grant", {"user": "root", "role": "root"})
    await c.call("auth/role/add", {"name": "tierkv"})
    perm = {"permType": "READWRITE", "key": b64("/tierkv/"), "range_end": b64(prefix_end("/tierkv/"))}
    await c.call("auth/role/grant", {"name": "tierkv", "perm": perm})
    await c.call("auth/user/add", {"name": "kv", "password": password})
    await c.call("auth/user/grant", {"user": "kv", "role": "tierkv"})
    await c.call("auth/enable", {})
    await c.close()


async def _members(url: str, sec: EtcdSecurity, n: int, timeout_s: float) -> EtcdMembership:
    m = EtcdMembership(url, security=sec)
    await m.start(timeout_s)
    end = time.monotonic() + timeout_s
    while len(m.members) < n and time.monotonic() < end:
        await m.wait_changed(m.version, 0.2)
    return m


async def test_cluster_membership_through_etcd_with_tls_client_certs_and_a_user(
    tls_etcd, start_daemon, tmp_path
):
    e, f = tls_etcd
    (tmp_path / "pw").write_text("kv-pass-0001\n")
    certs = EtcdSecurity(str(f.ca), str(f.client_cert), str(f.client_key))
    await _enable_auth(e, certs, "kv-pass-0001")
    keys = {
        "etcd_ca_file": str(f.ca),
        "etcd_cert_file": str(f.client_cert),
        "etcd_key_file": str(f.client_key),
        "etcd_user": "kv",
        "etcd_password_file": str(tmp_path / "pw"),
    }
    url = e.url("tls")
    ds = [start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 3, **keys}) for _ in range(2)]
    full = EtcdSecurity(**{k.removeprefix("etcd_"): v for k, v in keys.items()})
    m = await _members(url, full, 2, 30.0)
    assert {x.addr for x in m.members} == {d.addr for d in ds}, [d.logs()[-2000:] for d in ds]
    ds.append(start_daemon(use_disk=False, cluster={"join": url, "lease_ttl_s": 3, **keys}))
    end = time.monotonic() + 30
    while len(m.members) < 3 and time.monotonic() < end:  # the watch (authenticated) sees the join
        await m.wait_changed(m.version, 0.2)
    assert {x.addr for x in m.members} == {d.addr for d in ds}
    assert m.counters["etcd_errors"] == 0 and m.counters["lists"] == 1
    await m.close()

    (tmp_path / "bad").write_text("wrong-password\n")
    wrong = EtcdSecurity(str(f.ca), str(f.client_cert), str(f.client_key), "kv", str(tmp_path / "bad"))
    no_cert = EtcdSecurity(str(f.ca), "", "", "kv", str(tmp_path / "pw"))
    for sec in (wrong, no_cert):
        m = await _members(url, sec, 1, 1.5)
        assert m.members == () and m.counters["etcd_errors"] >= 1
        await m.close()
