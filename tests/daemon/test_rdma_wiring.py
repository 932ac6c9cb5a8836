"""The RDMA wiring of the daemon and the client, as far as it runs without a verbs device:
HELLO's ``rdma`` field (validation, the node's answer), the ``server.transport`` and client
``transport`` selection with its one log line, the ``rdma`` flag of LEASE/RESERVE, the slab
descriptors (checked against the real DRAM arena's memory), and the fall-back to TCP after a
transport failure. Real daemons as subprocesses; nothing of ours is replaced by a fake. The
end-to-end RDMA test at the bottom needs a device and is skipped here."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from scraping import scrape_async

from kvstore import protocol as P
from kvstore.client.cluster import ClusterClient
from kvstore.client.config import ClientConfig
from kvstore.client.conn import Conn
from kvstore.client.node import NodeClient
from kvstore.client.rdma import ClientRdma, move
from kvstore.client.read import get_into
from kvstore.config import load_store_config
from kvstore.daemon.slab_rdma import slab_descriptor
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.results import Status
from rdma import verbs
from rdma.channel import SocketChannel
from rdma.tcp import TcpTransport
from rdma.transport import QPInfo, Region, RemoteDescriptor, TransportError, buffer_address

HAS_DEVICE = verbs.device_available()
OFFER = QPInfo(qp_num=0x123, psn=0x4567, lid=1, gid=bytes(range(16)), mtu=5)


def transport_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "event=transport " in line]


async def raw_hello(port: int, ns, **extra) -> tuple[SocketChannel, dict]:
    ch = await SocketChannel.connect("127.0.0.1", port)
    hello = {"op": "HELLO", "rid": 1, "v": P.PROTOCOL_VERSION, "token": "", "ns": [P.namespace_to_wire(ns)]}
    await ch.send_frame({**hello, **extra})
    return ch, await ch.recv_header(P.MAX_HEADER, P.MAX_HEADER)


async def call(ch: SocketChannel, header: dict) -> dict:
    await ch.send_frame(header)
    reply = await ch.recv_header(P.MAX_REPLY_HEADER, 1 << 40)
    if reply.get("plen"):
        await ch.discard(reply["plen"])
    return reply


# ---------------------------------------------------------------- HELLO's rdma field


@pytest.mark.parametrize(
    "offer, says",
    [
        ("yes", "rdma: qp info must be a map"),
        ({"qpn": 1}, "rdma: qp info lacks field 'psn'"),
        ({**OFFER.to_wire(), "gid": b"short"}, "rdma: qp info gid must be 16 bytes"),
        ({**OFFER.to_wire(), "mtu": 9}, "rdma: qp info mtu must be an IBV_MTU value"),
        ({**OFFER.to_wire(), "qpn": 1 << 24}, "rdma: qp info qpn/psn must fit 24 bits"),
    ],
)
async def test_malformed_qp_info_is_a_clear_error_and_the_daemon_keeps_serving(start_daemon, ns, offer, says):
    d = start_daemon(use_disk=False)
    ch, reply = await raw_hello(d.data_port, ns, rdma=offer)
    assert reply["ok"] is False and reply["code"] == P.BAD_REQUEST
    assert reply["err"].startswith(says), reply["err"]
    # the connection stays: a correct HELLO on it is accepted and ops work
    again = await call(
        ch, {"op": "HELLO", "rid": 2, "v": P.PROTOCOL_VERSION, "token": "", "ns": [P.namespace_to_wire(ns)]}
    )
    assert again["ok"] is True and again["rdma"] is None
    assert (await call(ch, {"op": "EXISTS", "rid": 3, "keys": bytes(16)}))["tiers"] == b"\x00"
    ch.close()
    # and other clients are served
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,), transport="tcp"))
    assert (await c.lookup([BlockKey(bytes(16))])).names() == [None]
    await c.close()
    assert d.proc.poll() is None and "Traceback" not in d.logs()


async def test_offer_to_a_node_without_rdma_is_answered_nil_and_tcp_serves(start_daemon, ns, blocks_of):
    d = start_daemon(use_disk=False)  # server.transport = auto; this host has no device
    if HAS_DEVICE:
        pytest.skip("this host has an RDMA device: the node would accept the offer")
    conn = await Conn.open("127.0.0.1", d.data_port, "", None, [ns], None, OFFER)
    assert conn.hello["ok"] is True and conn.hello["rdma"] is None
    assert conn.peer_rdma is None and conn.verbs is None
    blocks = blocks_of(ns, 2, 3000)
    assert [p.status for p in await conn.put(blocks)] == [Status.STORED] * 2
    # descriptors on this connection are TCP ones (offsets, rkey 0) and READ moves the bytes
    leased = await conn.lease([h.key for h, _ in blocks], None)
    assert [(st, desc.addr, desc.rkey) for st, _, _, desc in leased] == [(Status.HIT, 0, 0)] * 2
    bufs = [bytearray(3000) for _ in blocks]
    assert await conn.transport().read([(b, x[3]) for b, x in zip(bufs, leased)]) == [True, True]
    assert bufs == [bytearray(p) for _, p in blocks]
    conn.close()
    hellos = await scrape_async(d.admin)
    assert hellos.value("tierkv_hellos_total", transport="tcp") == 1
    assert hellos.value("tierkv_hellos_total", 0.0, transport="rdma") == 0


async def test_one_sided_descriptors_on_a_tcp_connection_are_refused(start_daemon, ns, blocks_of):
    d = start_daemon(use_disk=False)
    ch, reply = await raw_hello(d.data_port, ns)
    assert reply["ok"] and reply["rdma"] is None
    (h, _p) = blocks_of(ns, 1, 1000)[0]
    for req in (
        {"op": "LEASE", "keys": h.key.raw, "rdma": True},
        {"op": "RESERVE", "hdrs": [h.encode()], "rdma": True},
    ):
        r = await call(ch, {**req, "rid": 5})
        assert (r["ok"], r["code"]) == (False, P.BAD_REQUEST)
        assert "no RDMA queue pair" in r["err"]
    r = await call(ch, {"op": "LEASE", "rid": 6, "keys": h.key.raw, "rdma": 1})
    assert r["code"] == P.BAD_REQUEST and "rdma must be true, false or nil" in r["err"]
    # rdma: false is the TCP path; the connection is still usable
    r = await call(ch, {"op": "RESERVE", "rid": 7, "hdrs": [h.encode()], "rdma": False})
    assert r["ok"] and r["res"][0][0] is None and r["res"][0][1][1:] == [0, 1000, 0]
    ch.close()


# ---------------------------------------------------------------- selection at start


async def test_auto_without_a_device_serves_tcp_with_one_log_line(start_daemon, ns):
    if HAS_DEVICE:
        pytest.skip("this host has an RDMA device")
    d = start_daemon(use_disk=False)
    for offer in (None, OFFER, OFFER):
        conn = await Conn.open("127.0.0.1", d.data_port, "", None, [ns], None, offer)
        conn.close()
    d.stop()
    lines = transport_lines(d.logs())
    assert len(lines) == 1, lines
    assert "selected=tcp" in lines[0] and 'reason="no RDMA device on this host"' in lines[0]


async def test_tcp_says_so_once_and_ignores_offers(start_daemon, ns):
    d = start_daemon(use_disk=False, server={"transport": "tcp"})
    conn = await Conn.open("127.0.0.1", d.data_port, "", None, [ns], None, OFFER)
    assert conn.peer_rdma is None
    conn.close()
    d.stop()
    lines = transport_lines(d.logs())
    assert len(lines) == 1 and 'reason="server.transport is tcp"' in lines[0], lines


def _serve(*sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", *args], capture_output=True, text=True, timeout=60
    )


def test_rdma_without_a_device_fails_at_start_naming_the_key(tmp_path):
    if HAS_DEVICE:
        pytest.skip("this host has an RDMA device")
    port_file = tmp_path / "ports.json"
    r = _serve("server.transport=rdma", "disk.enabled=false", f"server.port_file={port_file}")
    assert r.returncode == 2
    assert "server.transport is 'rdma' but this host has no RDMA device" in r.stderr, r.stderr
    assert not port_file.exists()  # nothing was served


def test_rdma_config_keys_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="server.rdma_gid_index"):
        load_store_config(None, {"server.rdma_gid_index": 256, "disk.enabled": False}, env={})
    with pytest.raises(ConfigError, match="server.transport"):
        load_store_config(None, {"server.transport": "roce", "disk.enabled": False}, env={})
    cfg = load_store_config(None, {"server.rdma_device": "mlx5_1", "disk.enabled": False}, env={})
    assert (cfg.server.rdma_device, cfg.server.rdma_gid_index) == ("mlx5_1", 0)


# ---------------------------------------------------------------- the client's transport option


def test_client_transport_option_is_checked():
    with pytest.raises(ValueError, match="transport"):
        ClientConfig(transport="roce")
    if HAS_DEVICE:
        pytest.skip("this host has an RDMA device")
    for make in (
        lambda: ClientRdma("rdma"),
        lambda: NodeClient("127.0.0.1:1", ClientConfig(transport="rdma")),
        lambda: ClusterClient.static(["127.0.0.1:1", "127.0.0.1:2"], ClientConfig(transport="rdma")),
    ):
        with pytest.raises(TransportError, match="^transport is 'rdma' but this host has no RDMA device"):
            make()
    assert ClientRdma("tcp").device is None and ClientRdma("auto").device is None


_CLIENT_SCRIPT = """
import asyncio, sys
import numpy as np
from kvstore.daemon.logs import setup_logging
from kvstore.client.cluster import ClusterClient
from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.keys import Namespace

async def main(addrs):
    setup_logging("INFO")
    cfg = ClientConfig(namespaces=(Namespace("test-model", "uint8", 4),))
    sc = ClusterClient.static(addrs, cfg)
    nc = NodeClient(addrs[0], cfg)
    buf = np.zeros(4096, np.uint8)
    sc.register(buf)
    nc.register(buf)
    from kvstore.keys import BlockKey
    keys = [BlockKey(bytes([i]) * 16) for i in range(6)]
    print((await sc.lookup(keys)).names(), (await nc.lookup(keys)).names())
    await sc.close()
    await nc.close()

asyncio.run(main(sys.argv[1:]))
"""


def test_client_auto_without_a_device_uses_tcp_with_one_log_line(start_daemon):
    if HAS_DEVICE:
        pytest.skip("this host has an RDMA device")
    a, b = start_daemon(use_disk=False), start_daemon(use_disk=False)
    r = subprocess.run(
        [sys.executable, "-c", _CLIENT_SCRIPT, a.addr, b.addr], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{[None] * 6} {[None] * 6}"
    lines = transport_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "selected=tcp" in lines[0] and "no RDMA device on this host" in lines[0]


# ---------------------------------------------------------------- failure -> miss -> TCP


async def test_a_failing_one_sided_transport_is_a_counted_miss_and_the_connection_falls_back(
    start_daemon, ns, blocks_of
):
    """``client_rdma.move`` with a transport that fails (a real TcpTransport over a channel that
    is already closed, and one given a buffer shorter than its descriptor): every pair is False,
    counted, nothing raises, and the connection continues over TCP."""
    d = start_daemon(use_disk=False)
    conn = await Conn.open("127.0.0.1", d.data_port, "", None, [ns], None, None)
    blocks = blocks_of(ns, 2, 2000)
    await conn.put(blocks)
    leased = await conn.lease([h.key for h, _ in blocks], None)
    slab = Region(addr=1 << 40, length=1 << 30, rkey=7)
    counters: Counter[str] = Counter()
    dead = await SocketChannel.connect("127.0.0.1", d.data_port)
    dead.close()
    # completions False: the transport's connection is gone
    conn.use_verbs(TcpTransport(dead, conn.frames), slab)
    assert (
        await move(conn, "read", [(bytearray(2000), x[3]) for x in leased], counters, d.addr) == [False] * 2
    )
    assert conn.verbs is None and conn.slab is None and counters["rdma_failures"] == 2
    # an exception from the transport (local buffers shorter than the descriptors)
    conn.use_verbs(TcpTransport(await SocketChannel.connect("127.0.0.1", d.data_port), conn.frames), slab)
    assert await move(conn, "write", [(bytearray(10), x[3]) for x in leased], counters, d.addr) == [False] * 2
    assert conn.verbs is None and counters["rdma_failures"] == 4
    # the connection still works, over TCP
    bufs = [bytearray(2000) for _ in blocks]
    assert await conn.transport().read([(b, x[3]) for b, x in zip(bufs, leased)]) == [True, True]
    assert bufs == [bytearray(p) for _, p in blocks]
    conn.close()


async def test_one_sided_descriptors_outside_the_nodes_slab_are_refused(start_daemon, ns):
    d = start_daemon(use_disk=False)
    conn = await Conn.open("127.0.0.1", d.data_port, "", None, [ns], None, None)
    with pytest.raises(TransportError, match="without RDMA"):
        await conn.lease([], None, rdma=True)
    conn.slab = Region(addr=1 << 40, length=1 << 20, rkey=7)
    inside = RemoteDescriptor(1, (1 << 40) + 10, 100, 7)
    assert conn._check_desc(inside, rdma=True) == inside
    # another key is fine (each lease's window has its own); the range must lie in the slab
    other_key = RemoteDescriptor(1, 1 << 40, 100, 8)
    assert conn._check_desc(other_key, rdma=True) == other_key
    for bad in (RemoteDescriptor(1, (1 << 40) - 1, 100, 7), RemoteDescriptor(1, 1 << 40, (1 << 20) + 1, 7)):
        with pytest.raises(P.ProtocolError, match="outside the node's registered slab"):
            conn._check_desc(bad, rdma=True)
    conn.close()


# ---------------------------------------------------------------- slab descriptors


async def test_slab_descriptors_address_the_real_dram_bytes(tmp_path, ns, blocks_of):
    """What an RDMA READ at a LEASE descriptor would fetch, and where an RDMA WRITE at a
    RESERVE descriptor would land, checked by reading and writing the node's DRAM arena at
    those addresses (ctypes) instead of through a NIC."""
    from kvstore.node.store import NodeStore

    def cfg(**kw):
        base = {"dram.capacity": "8MiB", "dram.slab_size": "1MiB", "disk.path": str(tmp_path / "disk")}
        return load_store_config(None, {**base, "disk.sync": False, **kw}, env={})

    node = await NodeStore.open(cfg())
    base, length = buffer_address(node.dram_buffer)
    slab = Region(base, length, rkey=0x5EED)
    blocks = blocks_of(ns, 3, 50_000, seed=4)
    await node.writer.put(blocks[:2])
    leases = await node.leaser.lease([h.key for h, _ in blocks[:2]])
    for i, lease in enumerate(leases):
        desc = slab_descriptor(slab, 100 + i, lease)
        assert desc.handle == 100 + i and desc.rkey == 0x5EED and slab.holds(desc)
        assert ctypes.string_at(desc.addr, desc.length) == blocks[i][1]
    node.state.release(leases)
    (h, payload) = blocks[2]
    [r] = await node.writer.reserve([h])
    desc = slab_descriptor(slab, 9, r)
    assert slab.holds(desc) and desc.length == len(payload)
    ctypes.memmove(desc.addr, payload, len(payload))  # the one-sided write
    [pr] = await node.writer.commit([r])
    assert pr.status is Status.STORED
    out = bytearray(len(payload))
    [g] = await node.reader.read([h.key], [out])
    assert g.status is Status.HIT and out == payload
    await node.close()

    # a block outside the DRAM slab (a private copy of a disk block) has no slab descriptor
    disk_only = await NodeStore.open(cfg(**{"dram.capacity": 0, "disk.path": str(tmp_path / "disk2")}))
    await disk_only.writer.put(blocks[:1])
    [lease] = await disk_only.leaser.lease([blocks[0][0].key])
    assert lease.offset is None and slab_descriptor(slab, 1, lease) is None
    disk_only.state.release([lease])
    await disk_only.close()


# ---------------------------------------------------------------- with a device (skipped here)


@pytest.mark.skipif(not HAS_DEVICE, reason="no RDMA device on this machine")
async def test_rdma_end_to_end(start_daemon, ns, blocks_of):  # pragma: no cover - never ran here
    d = start_daemon(use_disk=False, server={"transport": "rdma"})
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,), transport="rdma"))
    staging = np.zeros((4, 5000), np.uint8)
    c.register(staging)
    blocks = blocks_of(ns, 4, 5000, seed=5)
    for i, (_, p) in enumerate(blocks):
        staging[i] = np.frombuffer(p, np.uint8)
    res = await c.put([(h, staging[i]) for i, (h, _) in enumerate(blocks)])
    assert [r.status for r in res] == [Status.STORED] * 4
    staging[:] = 0
    got = await get_into(c, [h.key for h, _ in blocks], list(staging))
    assert [g.status for g in got] == [Status.HIT] * 4
    assert all(staging[i].tobytes() == p for i, (_, p) in enumerate(blocks))
    assert c.counters["rdma_failures"] == 0
    assert (await scrape_async(d.admin)).value("tierkv_hellos_total", transport="rdma") >= 1
    await c.close()
