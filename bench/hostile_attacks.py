"""The attacks bench/hostile.py runs beside its well-behaved tenant (each listed in its
docstring), the raw data-port frames they speak, and the probes that count what an attack cost
(admitted connections, RSS, unsent bytes, admin counters). ``ATTACKS``: name -> attack; an
attack starts on the daemon's ports and returns the function that stops it. One file over
~350 lines on purpose: each attack is a short function over the same raw-frame helpers, and
security reviews read the whole list in one place."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import common  # noqa: F401 - puts the repository and tests/ on the path
import msgpack
import numpy as np
from daemonutil import frame as _frame  # a request's length prefix and header

from kvstore import protocol as P
from kvstore.block import make_header
from kvstore.keys import Namespace
from kvstore.results import Status

MiB = 1 << 20
GOOD, BAD, OPERATOR = "tok-good-tenant", "tok-bad-tenant1", "tok-operator-bench"
NS = Namespace("bench-hostile", "uint8", 16)
IDLE = 1000
STALLED = 5


def _reply(s: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        b = b""
        while len(b) < n:
            c = s.recv(n - len(b))
            if not c:
                raise ConnectionError("closed")
            b += c
        return b

    (n,) = struct.unpack(">I", exact(4))
    return msgpack.unpackb(exact(n), raw=False)


def _hello(
    port: int, rcvbuf: int | None = None, token: str = BAD, namespaces: list[Namespace] | None = None
) -> tuple[socket.socket, str]:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(
        _frame(
            {
                "op": "HELLO",
                "rid": 0,
                "v": P.PROTOCOL_VERSION,
                "token": token,
                "ns": [P.namespace_to_wire(n) for n in (namespaces or [NS])],
            }
        )
    )
    r = _reply(s)
    assert r["ok"], r
    return s, r["salt"]


def _block(ns: Namespace, size: int, seed: int):
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 50000, ns.block_tokens)]
    payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    key = ns.block_keys(tokens)[0]
    h = make_header(
        key=key, parent=ns.id, namespace=ns.id, tokens=tokens, dtype="uint8", shape=[size], payload=payload
    )
    return h, payload


def _hostile(port: int) -> list[socket.socket]:
    """Stalled PUTs, stalled GETs and idle connections of the bad tenant (kept open)."""
    socks: list[socket.socket] = []
    s, salt = _hello(port)
    bad_ns = NS.with_tenant(salt)
    big = [_block(bad_ns, 4 * MiB, 1000 + i) for i in range(STALLED)]
    s.sendall(
        _frame({"op": "PUT", "rid": 1, "hdrs": [h.encode() for h, _ in big]}, sum(len(p) for _, p in big))
    )
    for _, p in big:
        s.sendall(p)
    assert _reply(s)["st"] == bytes([int(Status.STORED)]) * len(big)
    socks.append(s)
    for i in range(STALLED):  # GETs whose readers stop after 64 KiB
        g, _ = _hello(port, rcvbuf=64 << 10)
        g.sendall(_frame({"op": "GET", "rid": 1, "keys": big[i][0].key.raw}))
        _reply(g)
        g.recv(64 << 10)
        socks.append(g)
    for i in range(STALLED):  # PUTs whose writers stop after 1 MiB
        h, p = _block(bad_ns, 4 * MiB, 2000 + i)
        w, _ = _hello(port)
        w.sendall(_frame({"op": "PUT", "rid": 1, "hdrs": [h.encode()]}, len(p)))
        w.sendall(p[:MiB])
        socks.append(w)
    for _ in range(IDLE):
        socks.append(_hello(port)[0])
    return socks


def _admitted(port: int, n: int = 20) -> int:
    """New good connections whose HELLO succeeds, of ``n``."""
    ok = 0
    for _ in range(n):
        try:
            s, _ = _hello(port, token=GOOD)
            s.close()
            ok += 1
        except (AssertionError, ConnectionError, OSError):
            pass
    return ok


class _Loop:
    """A thread running ``step`` every ``period_s`` until stopped; what it opens is closed."""

    def __init__(self, step, period_s: float) -> None:
        self.step, self.period_s, self.socks = step, period_s, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(self.socks)
            except OSError:
                pass
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()
        for s in self.socks:
            s.close()


def _connect_from(source: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _preauth_flood(ports: dict):
    return _Loop(lambda socks: socks.append(_connect_from("127.0.0.2", ports["data_port"])), 0.02).stop


def _header_cpu(ports: dict):
    empties = _frame({"op": "HELLO", "rid": 0, "v": 1, "token": "nope-nope", "pad": [{}] * 65000})

    def step(_socks) -> None:
        s = _connect_from("127.0.0.2", ports["data_port"])
        try:
            s.sendall(empties)
            _reply(s)
        except (OSError, ConnectionError):
            pass
        s.close()

    return _Loop(step, 1 / 62).stop


def _header_memory(ports: dict):
    port = ports["data_port"]
    socks = []
    pad = [bytes([i % 251]) * 1000 for i in range(4000)]
    for i in range(8):
        s, salt = _hello(port)
        h, p = _block(NS.with_tenant(salt), MiB, 3000 + i)
        s.sendall(_frame({"op": "PUT", "rid": 1, "hdrs": [h.encode()], "pad": pad}, len(p)))
        s.sendall(p[:1024])
        socks.append(s)
    return lambda: [s.close() for s in socks]


def _discard(ports: dict):
    socks = []
    for _ in range(64):
        s, _ = _hello(ports["data_port"])
        s.sendall(_frame({"op": "EXISTS", "rid": 1, "keys": b""}, 60 * MiB))
        s.sendall(b"x" * 1024)
        socks.append(s)
    return lambda: [s.close() for s in socks]


def _leases(ports: dict):
    port = ports["data_port"]
    s, salt = _hello(port)
    h, p = _block(NS.with_tenant(salt), 4096, 4000)
    s.sendall(_frame({"op": "PUT", "rid": 1, "hdrs": [h.encode()]}, len(p)))
    s.sendall(p)
    _reply(s)
    socks = [s]
    for _ in range(6):
        c, _ = _hello(port)
        c.sendall(_frame({"op": "LEASE", "rid": 1, "keys": h.key.raw * 4096, "ttl": 300.0}))
        _reply(c)
        socks.append(c)
    return lambda: [s.close() for s in socks]


def _reserve(ports: dict):
    s, salt = _hello(ports["data_port"])
    bad_ns = NS.with_tenant(salt)
    hdrs = [_block(bad_ns, MiB, 5000 + i)[0].encode() for i in range(2048)]
    s.sendall(_frame({"op": "RESERVE", "rid": 1, "hdrs": hdrs}))
    _reply(s)
    return s.close


def _admin_flood(ports: dict):
    socks = []
    for _ in range(500):
        try:
            socks.append(_connect_from("127.0.0.2", ports["admin_port"]))
        except OSError:
            break
    return lambda: [s.close() for s in socks]


def _healthz(ports: dict, n: int = 20) -> int:
    ok = 0
    for _ in range(n):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['admin_port']}/healthz", timeout=5) as r:
                ok += r.status == 200
        except OSError:
            pass
    return ok


FRESH = 240  # namespaces of the ns_flood attack (under limits.max_namespaces_per_tenant)


def _put(s: socket.socket, blocks) -> dict:
    s.sendall(
        _frame(
            {"op": "PUT", "rid": 1, "hdrs": [h.encode() for h, _ in blocks]}, sum(len(p) for _, p in blocks)
        )
    )
    for _, p in blocks:
        s.sendall(p)
    return _reply(s)


def _ns_flood(ports: dict, ctx: dict):
    port = ports["data_port"]
    refused = 0
    for c in range(FRESH // 60):
        nss = [Namespace(f"bench-fresh-{c * 60 + i}", "uint8", 16) for i in range(60)]
        try:
            s, salt = _hello(port, namespaces=nss)
        except AssertionError:  # a HELLO past the namespace cap
            refused += 1
            continue
        for i, n in enumerate(nss):
            _put(s, [_block(n.with_tenant(salt), MiB, 7000 + 2 * (c * 60 + i) + j) for j in range(2)])
        s.close()
    ctx["extra"]["hellos_refused"] = refused
    return lambda: None


# The operator's scraper, in a process of its own (a thread here would take the GIL from the
# good client, which is what would be measured): a line per scrape, its size.
_SCRAPER = """
import sys, time, urllib.request
base, token = sys.argv[1], sys.argv[2]
while True:
    for path in ("/metrics", "/v1/stats"):
        req = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + token})
        with urllib.request.urlopen(req, timeout=30) as r:
            print(len(r.read()), flush=True)
    time.sleep(0.25)
"""


def _metrics_scrape(ports: dict, ctx: dict):
    child = subprocess.Popen(
        [sys.executable, "-c", _SCRAPER, f"http://127.0.0.1:{ports['admin_port']}", OPERATOR],
        stdout=subprocess.PIPE,
        text=True,
    )

    def stop() -> None:
        child.terminate()
        out, _ = child.communicate(timeout=30)
        sizes = [int(x) for x in out.split()]
        ctx["extra"]["scrape_kib"] = round(max(sizes, default=0) / 1024, 1)
        ctx["extra"]["scrapes"] = len(sizes)

    return stop


def _tiny_blocks(ports: dict, ctx: dict):
    s, salt = _hello(ports["data_port"])
    ns = NS.with_tenant(salt)
    for i in range(0, 50_000, 2_000):
        _put(s, [_block(ns, 4, 100_000 + i + j) for j in range(2_000)])
    return s.close


def _foreign_exists(ports: dict, ctx: dict):
    s, _ = _hello(ports["data_port"])
    foreign, absent = [], []
    for i in range(400):
        pair = ((ctx["good_keys"][i % len(ctx["good_keys"])].raw, foreign), (bytes([i % 251, 3]) * 8, absent))
        for key, out in pair if i % 2 else pair[::-1]:  # either first: no order effect
            t0 = time.perf_counter()
            s.sendall(_frame({"op": "EXISTS", "rid": 1, "keys": key}))
            _reply(s)
            out.append(time.perf_counter() - t0)
    f, a = np.array(foreign[50:]), np.sort(np.array(absent[50:]))
    lo, hi = np.searchsorted(a, f, "left"), np.searchsorted(a, f, "right")
    ctx["extra"]["foreign_vs_absent_auc"] = round(float((lo + 0.5 * (hi - lo)).sum() / (len(f) * len(a))), 3)
    return s.close


def _admin_parse(ports: dict, ctx: dict):
    line = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n"

    def step(_socks) -> None:
        s = _connect_from("127.0.0.2", ports["admin_port"])
        try:
            s.sendall(line)
            s.recv(4096)
        except OSError:
            pass
        s.close()

    return _Loop(step, 1 / 200).stop


def _pipeline(ports: dict, ctx: dict):
    port = ports["data_port"]
    s, salt = _hello(port)
    [(h, p)] = [_block(NS.with_tenant(salt), MiB, 9000)]
    _put(s, [(h, p)])
    socks = [s]
    for _ in range(32):
        c, _ = _hello(port, rcvbuf=64 << 10)
        c.sendall(b"".join(_frame({"op": "GET", "rid": 1 + i, "keys": h.key.raw}) for i in range(16)))
        socks.append(c)
    time.sleep(0.5)
    ctx["extra"]["kernel_unsent_mib"] = round(_unsent(port) / MiB, 1)
    return lambda: [c.close() for c in socks]


def _unsent(port: int) -> int:
    """Bytes the daemon's data-port connections have sent and not had acknowledged."""
    total = 0
    with open("/proc/net/tcp") as f:
        for row in (line.split() for line in f.readlines()[1:]):
            if int(row[1].split(":")[1], 16) == port and row[3] == "01":
                total += int(row[4].split(":")[0], 16)
    return total


def _admin_counter(ports: dict, name: str) -> float | None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{ports['admin_port']}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                return float(line.split()[-1])
    return None


def _old(attack):
    """An attack of issue 22, which needs nothing from the run."""
    return lambda ports, ctx: attack(ports)


ATTACKS = {
    "preauth_flood": _old(_preauth_flood),
    "header_cpu": _old(_header_cpu),
    "header_memory": _old(_header_memory),
    "discard": _old(_discard),
    "leases": _old(_leases),
    "reserve": _old(_reserve),
    "admin_flood": _old(_admin_flood),
    # issue 34
    "ns_flood": _ns_flood,
    "metrics_scrape": _metrics_scrape,
    "tiny_blocks": _tiny_blocks,
    "foreign_exists": _foreign_exists,
    "admin_parse": _admin_parse,
    "pipeline": _pipeline,
}
