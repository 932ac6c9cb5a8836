"""Restarts: graceful SIGTERM with the disk tier, and kill -9 in the middle of GETs."""

from __future__ import annotations

import asyncio
import time

from polling import until_async
from storeutil import read_back

from kvstore.client.config import ClientConfig
from kvstore.client.node import NodeClient
from kvstore.client.read import get_into
from kvstore.results import Status

MiB = 1 << 20


async def test_sigterm_then_restart_finds_every_block(start_daemon, ns, blocks_of, tmp_path):
    wd = tmp_path / "node"
    d = start_daemon(workdir=wd, disk={"sync": True})
    c = NodeClient(d.addr, ClientConfig(namespaces=(ns,)))
    blocks = blocks_of(ns, 12, 300_000)
    res = await c.put(blocks)
    assert [(r.status, r.durable) for r in res] == [(Status.STORED, True)] * len(blocks), res
    await c.close()
    assert d.stop() == 0
    assert "event=stopped" in d.logs()

    d2 = start_daemon(workdir=wd)
    c = NodeClient(d2.addr, ClientConfig(namespaces=(ns,)))
    assert await read_back(c, blocks, 30.0, 30.0) == (12, 0)  # every block found, read whole
    await c.close()


async def test_kill9_mid_get_gives_misses_then_recovers(start_daemon, ns, blocks_of, tmp_path):
    wd = tmp_path / "node"
    d = start_daemon(workdir=wd)
    cfg = ClientConfig(namespaces=(ns,), op_timeout_s=2.0, probe_interval_s=0.1, pool_size=2)
    c = NodeClient(d.addr, cfg)
    blocks = blocks_of(ns, 16, 2 * MiB, seed=4)
    assert [r.status for r in await c.put(blocks)] == [Status.STORED] * len(blocks)
    keys = [h.key for h, _ in blocks]
    outcomes: list[tuple[float, list[Status]]] = []  # (when the GET started, statuses)
    stop = asyncio.Event()

    async def reader():
        bufs = [bytearray(2 * MiB) for _ in keys]
        while not stop.is_set():
            started = time.monotonic()
            got = await get_into(c, keys, bufs)
            for g, b, (_, p) in zip(got, bufs, blocks):
                assert g.status is not Status.HIT or bytes(b) == p  # a hit is never wrong data
            outcomes.append((started, [g.status for g in got]))

    tasks = [asyncio.create_task(reader()) for _ in range(2)]
    while len(outcomes) < 4:
        await asyncio.sleep(0.01)
    d.kill9()  # returns once the process is gone
    t0 = time.monotonic()
    n = len(outcomes)
    await until_async(
        lambda: len(outcomes),
        10.0,
        "4 more reads done after kill -9",
        ok=lambda k: k >= n + 4,
        interval_s=0.01,
    )
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    # a GET that began before the kill may still finish with hits (its bytes had arrived);
    # every GET that began after it is a miss
    after = [st for started, st in outcomes if started > t0]
    assert after and all(s is not Status.HIT for st in after for s in st)
    assert not c.up and c.counters["node_down"] == 1
    assert c.counters["errors"] + c.counters["timeouts"] >= 1

    # the node comes back on the same port; the background probe notices and reads hit again
    d2 = start_daemon(workdir=wd, server={"data_port": d.data_port})
    await until_async(lambda: c.up, 15.0, "the client's probe to find the node up")
    bufs = [bytearray(2 * MiB) for _ in keys]
    got = await get_into(c, keys, bufs)
    assert [g.status for g in got] == [Status.HIT] * 16
    assert all(bytes(b) == p for b, (_, p) in zip(bufs, blocks))
    await c.close()
    assert d2.stop() == 0


def test_sigterm_finishes_the_request_in_flight(start_daemon, ns, blocks_of):
    import signal
    import socket
    import struct

    import msgpack

    from kvstore import protocol as P

    d = start_daemon()
    [(h, payload)] = blocks_of(ns, 1, 3 * MiB, seed=12)

    def frame(header, body=b""):
        raw = msgpack.packb(header, use_bin_type=True)
        return struct.pack(">I", len(raw)) + raw + body

    def read_reply(s):
        data = b""
        while len(data) < 4:
            chunk = s.recv(4 - len(data))
            if not chunk:
                return None
            data += chunk
        (n,) = struct.unpack(">I", data)
        body = b""
        while len(body) < n:
            body += s.recv(n - len(body))
        return msgpack.unpackb(body, raw=False)

    idle = socket.create_connection(("127.0.0.1", d.data_port), timeout=10)
    s = socket.create_connection(("127.0.0.1", d.data_port), timeout=10)
    s.sendall(frame({"op": "HELLO", "rid": 1, "v": P.PROTOCOL_VERSION, "ns": [P.namespace_to_wire(ns)]}))
    assert read_reply(s)["ok"]
    s.sendall(frame({"op": "PUT", "rid": 2, "hdrs": [h.encode()], "plen": len(payload)}) + payload[:MiB])
    time.sleep(0.3)  # the daemon is now inside the PUT, waiting for the rest of the payload
    d.signal(signal.SIGTERM)
    time.sleep(0.3)
    assert idle.recv(1) == b"", "idle connections are closed at once"
    s.sendall(payload[MiB:])
    reply = read_reply(s)
    assert reply["ok"] and reply["st"][0] == int(Status.STORED)
    assert read_reply(s) is None, "then the connection is closed"
    assert d.proc.wait(30) == 0
    assert "event=stopped" in d.logs()


def test_during_a_slow_start_connects_are_refused_and_readyz_says_503(tmp_path):
    """A daemon that prefaults 2 GiB of DRAM takes a while to open its node: meanwhile a
    connect to the data port is refused at once (never left hanging in a backlog), /readyz
    answers 503, and then 200 once the port serves."""
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from daemonutil import REPO
    from ports import free_port

    data_port, admin_port = free_port(), free_port()
    (tmp_path / "node.toml").write_text(
        '[dram]\ncapacity = "2GiB"\nslab_size = "4MiB"\nprefault = true\npin = "false"\n'
        "[disk]\nenabled = false\n"
        f'[server]\ndata_port = {data_port}\nadmin_port = {admin_port}\nport_file = "{tmp_path / "ports.json"}"\n'
    )
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(tmp_path / "node.toml")],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    refused, not_ready, hung = 0, 0, 0
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ports.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=2):
                    pass
            except urllib.error.HTTPError as exc:
                not_ready += exc.code == 503
            except OSError:
                pass  # the admin port is not up yet
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", data_port))
                if not (tmp_path / "ports.json").exists():
                    s.sendall(b"\0\0\0\1\x80")  # a connect accepted before serving must still be answered
                    try:
                        hung += not s.recv(1)
                    except TimeoutError:
                        hung += 1
            except ConnectionRefusedError:
                refused += 1
            finally:
                s.close()
            time.sleep(0.02)
        assert json.loads((tmp_path / "ports.json").read_text())["data_port"] == data_port
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/readyz", timeout=2) as r:
            assert r.status == 200
        assert refused >= 1 and not_ready >= 1 and hung == 0, (refused, not_ready, hung)
    finally:
        proc.terminate()
        proc.wait(30)
