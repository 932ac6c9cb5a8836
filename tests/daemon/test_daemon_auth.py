"""Tokens on both ports, tenant isolation, and token reload on SIGHUP."""

from __future__ import annotations

import signal

import aiohttp
import pytest
from polling import until, until_async
from scraping import scrape_async
from storeutil import remade

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

TOKENS = "tok-acme-0001 acme\ntok-globex-01 globex\ntok-operator1 *\n"


@pytest.fixture
def authed(start_daemon, tmp_path):
    f = tmp_path / "tokens.txt"
    f.write_text(TOKENS)
    d = start_daemon(auth={"token_file": str(f)})
    d.token_file = f
    return d


def client(d, ns, token, **kw) -> NodeClient:
    # no background re-probing during a test: every refused HELLO below is one we count
    return NodeClient(
        d.addr, ClientConfig(token=token, namespaces=(ns,), op_timeout_s=3, probe_interval_s=60, **kw)
    )


async def test_wrong_token_is_refused_on_both_ports(authed, ns, blocks_of):
    bad = client(authed, ns, "tok-nobody-000")
    blocks = blocks_of(ns, 1, 100)
    assert [r.status for r in await bad.put(blocks)] == [Status.ERROR]
    assert bad.counters["auth_refused"] == 1 and not bad.up
    assert (await get_into(bad, [blocks[0][0].key], [bytearray(100)]))[0].status is Status.MISS  # skipped
    await bad.close()
    op = client(authed, ns, "tok-operator1")  # the operator token is admin-only
    assert ((await op.lookup([blocks[0][0].key])).names()) == [None] and op.counters["auth_refused"] == 1
    await op.close()
    claim = client(authed, ns, "tok-acme-0001", tenant="globex")  # claiming another tenant
    assert ((await claim.lookup([blocks[0][0].key])).names()) == [None] and claim.counters[
        "auth_refused"
    ] == 1
    await claim.close()

    async with aiohttp.ClientSession(authed.admin) as s:
        assert (await s.get("/healthz")).status == 200  # probes stay open
        assert (await s.get("/v1/blocks")).status == 401
        assert (await s.get("/metrics", headers={"Authorization": "Bearer wrong-token"})).status == 401
        assert (await s.get("/v1/stats", headers={"Authorization": "Bearer tok-acme-0001"})).status == 403
    m = await scrape_async(authed.admin, "tok-operator1")
    assert m.value("tierkv_auth_failures_total", port="data") == 3
    assert m.value("tierkv_auth_failures_total", port="admin") == 3


async def test_tenants_are_isolated(authed, ns, blocks_of):
    acme = client(authed, ns, "tok-acme-0001")
    globex = client(authed, ns, "tok-globex-01")
    # each tenant computes keys in its own salted namespace; the node salts with the token's tenant
    acme_blocks = blocks_of(ns.with_tenant("acme"), 3, 500)
    assert [r.status for r in await acme.put(acme_blocks)] == [Status.STORED] * 3
    assert acme.hello["salt"] == "acme"
    keys = [h.key for h, _ in acme_blocks]
    # globex knows acme's keys: still nothing is visible, readable, deletable or overwritable
    assert (await globex.lookup(keys)).names() == [None] * 3
    got = await get_into(globex, keys, [bytearray(500) for _ in keys])
    assert [g.status for g in got] == [Status.MISS] * 3
    leasing = client(authed, ns, "tok-globex-01", descriptors="always")  # LEASE, not GET
    assert [g.status for g in await get_into(leasing, keys, [bytearray(500) for _ in keys])] == [
        Status.MISS
    ] * 3
    await leasing.close()
    assert await globex.delete(keys) == [False] * 3
    assert [r.status for r in await globex.put(acme_blocks)] == [Status.INVALID] * 3
    # globex's own blocks for the same prompt live beside acme's, under other keys
    globex_blocks = blocks_of(ns.with_tenant("globex"), 3, 500)
    assert not {h.key for h, _ in globex_blocks} & set(keys)
    assert [r.status for r in await globex.put(globex_blocks)] == [Status.STORED] * 3
    assert (await acme.lookup(keys)).names() == ["dram"] * 3
    assert (await acme.lookup([h.key for h, _ in globex_blocks])).names() == [None] * 3
    # an unsalted namespace id is refused too
    assert [r.status for r in await acme.put(blocks_of(ns, 1, 500))] == [Status.INVALID]
    await acme.close()
    await globex.close()


async def test_sighup_reloads_tokens(authed, ns, blocks_of):
    authed.token_file.write_text("tok-newcomer1 acme\ntok-operator1 *\n")
    authed.signal(signal.SIGHUP)
    await until_async(lambda: "tokens_reloaded" in authed.logs(), 20.0, "the tokens reloaded (log)")
    new = client(authed, ns, "tok-newcomer1")
    assert (await new.lookup([blocks_of(ns, 1, 10)[0][0].key])).names() == [None] and new.up
    old = client(authed, ns, "tok-acme-0001")
    (await old.lookup([blocks_of(ns, 1, 10)[0][0].key])).names()
    assert old.counters["auth_refused"] == 1
    # a broken file keeps the current table
    authed.token_file.write_text("broken-line-without-tenant\n")
    authed.signal(signal.SIGHUP)
    await until_async(lambda: "token_reload_failed" in authed.logs(), 20.0, "the failed reload logged")
    again = client(authed, ns, "tok-newcomer1")
    assert (await again.lookup([blocks_of(ns, 1, 10)[0][0].key])).names() == [None] and again.up
    for c in (new, old, again):
        await c.close()


def test_without_tokens_the_daemon_binds_loopback_only(start_daemon):
    d = start_daemon(server={"host": "0.0.0.0"})
    assert d.ports["host"] == "127.0.0.1"
    assert "no_auth_loopback_only" in d.logs()


# ---------------------------------------------------------------- issue 12: nothing revealed


@pytest.fixture
def secret_authed(start_daemon, tmp_path):
    f = tmp_path / "tokens.txt"
    f.write_text(TOKENS)
    s = tmp_path / "salt.secret"
    s.write_text("a-cluster-wide-secret-0123456789\n")

    def start():
        d = start_daemon(auth={"token_file": str(f), "salt_secret_file": str(s)})
        d.token_file = f
        return d

    return start


async def test_salts_are_secret_and_the_client_keys_with_them(secret_authed, ns, blocks_of):
    d1, d2 = secret_authed(), secret_authed()
    acme1, acme2 = client(d1, ns, "tok-acme-0001"), client(d2, ns, "tok-acme-0001")
    globex = client(d1, ns, "tok-globex-01")
    salt = await acme1.salt()
    assert salt not in ("", "acme") and len(salt) == 32
    assert await acme2.salt() == salt  # every node with the secret hands out the same salt
    assert await globex.salt() not in (salt, "globex")
    tns = await acme1.tenant_namespace(ns)
    assert tns == ns.with_tenant(salt)
    blocks = blocks_of(tns, 2, 300)
    assert [r.status for r in await acme1.put(blocks)] == [Status.STORED] * 2
    # keys computed with the public tenant name are not acme's: refused, not stored
    assert [r.status for r in await acme1.put(blocks_of(ns.with_tenant("acme"), 1, 300))] == [Status.INVALID]
    for c in (acme1, acme2, globex):
        await c.close()


async def test_replies_about_another_tenants_block_equal_those_about_an_absent_one(authed, ns, blocks_of):
    from daemonutil import RawPeer

    acme = client(authed, ns, "tok-acme-0001")
    [(h, p)] = blocks_of(ns.with_tenant("acme"), 1, 500)
    assert [r.status for r in await acme.put([(h, p)])] == [Status.STORED]
    absent = bytes(16)
    g = RawPeer(authed.data_port)
    g.hello("tok-globex-01", ns)
    replies = []
    for key in (h.key.raw, absent):
        for req in (
            {"op": "GET", "keys": key},
            {"op": "EXISTS", "keys": key},
            {"op": "LEASE", "keys": key},
            {"op": "DELETE", "keys": key},
        ):
            g.request(req)
            r = g.reply()
            r.pop("rid")
            replies.append(r)
    assert replies[:4] == replies[4:]
    assert all(r["ok"] for r in replies) and len(replies) == 8, replies
    # a block globex makes under acme's key (its own namespace) is not answered EXISTS

    [(gh, gp)] = blocks_of(ns.with_tenant("globex"), 1, 500)
    forged = remade(gh, gp, key=h.key)
    g.request({"op": "PUT", "hdrs": [forged.encode()]}, plen=len(gp))
    g.send(gp)
    assert g.reply()["st"][0] != int(Status.EXISTS)
    g.close()
    await acme.close()


async def test_stats_on_the_data_port_are_the_tenants_own(authed, ns, blocks_of):
    acme = client(authed, ns, "tok-acme-0001")
    globex = client(authed, ns, "tok-globex-01")
    assert [r.status for r in await acme.put(blocks_of(ns.with_tenant("acme"), 3, 500))] == [
        Status.STORED
    ] * 3
    mine = await globex.stats()
    assert set(mine) == {"tenant"}
    assert mine["tenant"]["tenant"] == "globex" and mine["tenant"].get("puts", 0) == 0
    theirs = await acme.stats()
    assert theirs["tenant"]["puts"] == 3
    await acme.close()
    await globex.close()


async def test_a_revoked_token_loses_its_open_connections(authed, ns):
    from daemonutil import RawPeer

    held = RawPeer(authed.data_port, timeout=5)
    held.hello("tok-acme-0001", ns)
    other = RawPeer(authed.data_port, timeout=5)
    other.hello("tok-globex-01", ns)
    authed.token_file.write_text("tok-globex-01 globex\ntok-operator1 *\n")
    authed.signal(signal.SIGHUP)
    assert held.closed_by_peer()
    other.request({"op": "EXISTS", "keys": bytes(16)})
    assert other.reply()["tiers"] == b"\x00"


def test_salt_secret_file_is_checked_and_salts_are_stable(tmp_path):
    from kvstore.daemon.auth import TokenTable
    from kvstore.errors import ConfigError

    tokens = tmp_path / "tokens.txt"
    tokens.write_text(TOKENS)
    short = tmp_path / "short"
    short.write_text("too-short")
    with pytest.raises(ConfigError, match="auth.salt_secret_file"):
        TokenTable.load(str(tokens), str(short))
    with pytest.raises(ConfigError, match="auth.salt_secret_file"):
        TokenTable.load(str(tokens), str(tmp_path / "missing"))
    good = tmp_path / "secret"
    good.write_text("0123456789abcdef0123\n")
    a, b = TokenTable.load(str(tokens), str(good)), TokenTable.load(str(tokens), str(good))
    assert a.salt_of("acme") == b.salt_of("acme") != a.salt_of("globex")
    assert TokenTable.load(str(tokens)).salt_of("acme") == "acme"  # no secret: the name
    assert TokenTable.load("").salt_of("") == ""  # no auth: one tenant, no salt


# ---------------------------------------------------------------- issue 12 follow-ups


def peer_hello(port: int, token: str):
    """A raw peer session (HELLO tenant "*", as another node's repair opens)."""
    from daemonutil import RawPeer, frame

    from kvstore import protocol as P

    p = RawPeer(port, timeout=5)
    p.send(frame({"op": "HELLO", "rid": 0, "v": P.PROTOCOL_VERSION, "token": token, "tenant": "*", "ns": []}))
    assert p.reply()["ok"]
    return p


async def test_a_peer_session_may_only_check_copy_in_and_read_stats(authed, ns, blocks_of):
    """The operator's peer session sees every tenant's blocks: EXISTS, PUT and STATS only;
    every other op is an ``auth`` reply (the connection stays) and leaves the block as it was."""
    from kvstore import protocol as P

    acme = client(authed, ns, "tok-acme-0001")
    [(h, p)] = blocks_of(ns.with_tenant("acme"), 1, 500)
    assert [r.status for r in await acme.put([(h, p)])] == [Status.STORED]
    peer = peer_hello(authed.data_port, "tok-operator1")
    key = h.key.raw
    refused = [
        ({"op": "GET", "keys": key}, 0),
        ({"op": "LEASE", "keys": key}, 0),
        ({"op": "DELETE", "keys": key}, 0),
        ({"op": "RESERVE", "hdrs": [h.encode()]}, 0),
        ({"op": "READ", "descs": [[1, 0, 500, 0]]}, 0),
        ({"op": "WRITE", "descs": [[1, 0, 500, 0]]}, 500),
        ({"op": "RELEASE", "handles": [1]}, 0),
        ({"op": "COMMIT", "handles": [1]}, 0),
    ]
    for req, plen in refused:
        peer.request(req, plen)
        peer.send(b"\0" * plen)
        rep = peer.reply()
        assert rep["ok"] is False and rep["code"] == P.AUTH, (req["op"], rep)
    peer.request({"op": "EXISTS", "keys": key})
    assert peer.reply()["tiers"] == b"\x02"  # still stored, and the connection still serves
    peer.request({"op": "STATS"})
    assert peer.reply()["ok"]
    buf = bytearray(500)
    assert [g.status for g in await get_into(acme, [h.key], [buf])] == [Status.HIT]
    await acme.close()


def test_a_changed_salt_secret_closes_the_connections_salted_with_the_old_one(secret_authed, ns):
    from daemonutil import RawPeer

    d = secret_authed()
    held = RawPeer(d.data_port, timeout=5)
    held.hello("tok-acme-0001", ns)
    secret = d.workdir.parent / "salt.secret"

    def reloads() -> int:
        return d.logs().count("tokens_reloaded")

    def sighup_and_wait(n: int) -> None:
        d.signal(signal.SIGHUP)
        until(reloads, 20.0, f"reload {n} logged", ok=lambda got: got >= n)
        assert reloads() == n

    sighup_and_wait(1)  # the same secret: the connection stays
    held.request({"op": "EXISTS", "keys": bytes(16)})
    assert held.reply()["tiers"] == b"\x00"
    secret.write_text("another-cluster-wide-secret-98765\n")
    sighup_and_wait(2)
    assert held.closed_by_peer()
