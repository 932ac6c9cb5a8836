"""A well-behaved client's GET latency beside hostile ones (docs/security.md).

One `kvstore serve` daemon on loopback with two tenants. The good tenant GETs 1 MiB blocks
one at a time (kvstore.client.node, checksum-verified) and its p50/p99 latency is measured:
  alone     nothing else connected
  hostile   beside 5 stalled PUTs (each sent 1 of 4 MiB, then nothing), 5 stalled GETs (each
            read 64 KiB of a 4 MiB reply, then nothing) and 1,000 idle authenticated
            connections of the other tenant
then beside each attack of issue 22, one at a time (the good tenant's p99 against its p99
alone measured just before that attack; 20 new good connections + HELLO each, counted; the
daemon's RSS growth):
  preauth_flood   connections re-opened from 127.0.0.2 at ~50/s, never sending HELLO
  header_cpu      pre-auth 64 KiB frames of empty msgpack maps, ~62 frames/s
  header_memory   8 authenticated PUTs behind ~4 MiB headers, their payloads stalled
  discard         64 EXISTS announcing 60 MiB payloads, stalled after 1 KiB
  leases          the bad tenant holds 24,576 leases (6 connections x 4,096)
  reserve         the bad tenant RESERVEs 2,048 x 1 MiB, never written (the good tenant's
                  DRAM blocks left in DRAM are counted)
  admin_flood     500 idle admin connections from 127.0.0.2 (/healthz probes counted)
and each attack of issue 34:
  ns_flood        the bad tenant writes 2 x 1 MiB blocks in each of 240 fresh namespaces (HELLOs
                  of 60), 480 MiB into a 512 MiB DRAM where the good tenant holds 80 MiB, 16 MiB
                  of it never read (how many of those 16 stay is the data lost: shares must
                  count tenants, not namespaces)
  metrics_scrape  the operator scrapes /metrics and /v1/stats every 0.25 s while those
                  namespaces are held (the scrape's size is reported)
  tiny_blocks     the bad tenant writes 50,000 blocks of 4 bytes (the index RAM they cost:
                  RSS growth, and the good tenant's misses)
  foreign_exists  the bad tenant EXISTS the good tenant's keys and absent ones, interleaved,
                  400 of each (the AUC of the two latency distributions: 0.5 tells nothing)
  admin_parse     ~200 requests/s with a 9,000-byte header line to the admin port from
                  127.0.0.2 (the daemon's log lines and bad_http count)
  pipeline        32 bad connections each pipeline 16 GETs of a 1 MiB block and never read
                  (the daemon's unacknowledged send queue, summed: what non-readers hold)
Target: p99 beside the hostile clients within 2x of p99 alone; new connections 100%
admitted. Prints a table and writes JSON (--json). Bounded: a fixed number of GETs per
phase, a few minutes in all.

    python bench/hostile.py --json .bench/hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import pct  # noqa: E402

from kvstore import protocol as P  # noqa: E402
from kvstore.block import make_header  # noqa: E402
from kvstore.client.node import ClientConfig, NodeClient  # noqa: E402
from kvstore.client.read import get_into  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.results import Status  # noqa: E402

MiB = 1 << 20
GOOD, BAD, OPERATOR = "tok-good-tenant", "tok-bad-tenant1", "tok-operator-bench"
NS = Namespace("bench-hostile", "uint8", 16)
IDLE = 1000
STALLED = 5


def _start(tmp: Path) -> tuple[subprocess.Popen, dict]:
    (tmp / "tokens").write_text(f"{GOOD} good\n{BAD} bad\n{OPERATOR} *\n")
    (tmp / "secret").write_text("bench-hostile-salt-secret-0123456789\n")
    (tmp / "node.toml").write_text(
        '[dram]\ncapacity = "512MiB"\nslab_size = "4MiB"\n[disk]\nenabled = false\n'
        f'[auth]\ntoken_file = "{tmp / "tokens"}"\nsalt_secret_file = "{tmp / "secret"}"\n'
        f"[limits]\nmax_conns_per_tenant = {IDLE + 64}\nmax_unauthenticated = 64\n"
        f'[server]\nport_file = "{tmp / "ports.json"}"\n'
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "serve",
            "--config",
            str(tmp / "node.toml"),
            "--log-level",
            "WARNING",
        ],
        cwd=REPO,
    )
    for _ in range(600):
        if (tmp / "ports.json").exists():
            return proc, json.loads((tmp / "ports.json").read_text())
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("daemon did not start")


def _frame(h: dict, plen: int = 0) -> bytes:
    body = msgpack.packb({**h, "plen": plen} if plen else h, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


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


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


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


async def _latencies(client: NodeClient, keys, n: int, misses: list[int] | None = None) -> list[float]:
    """``n`` GET latencies; a GET that misses fails the phase unless ``misses`` counts them
    (an attack that takes the good tenant's blocks is a result, not a crash)."""
    buf = np.empty(MiB, dtype=np.uint8)
    out = []
    rng = random.Random(7)
    for _ in range(n):
        k = keys[rng.randrange(len(keys))]
        t0 = time.perf_counter()
        [r] = await get_into(client, [k], [buf])
        out.append(time.perf_counter() - t0)
        if misses is not None:
            misses[0] += r.status is not Status.HIT
        else:
            assert r.status is Status.HIT, r
    return out


def _pct(xs: list[float], q: float) -> float:
    """The ``q`` percentile of ``xs`` (seconds), in ms."""
    return pct(xs, q / 100) * 1e3


async def _run(ports: dict, pid: int, gets: int, only: set[str]) -> dict:
    port = ports["data_port"]
    good = NodeClient(
        f"127.0.0.1:{port}", ClientConfig(token=GOOD, namespaces=(NS,), pool_size=1, op_timeout_s=10)
    )
    gns = await good.tenant_namespace(NS)
    blocks = [_block(gns, MiB, i) for i in range(64)]
    assert all(r.status is Status.STORED for r in await good.put(blocks))
    keys = [h.key for h, _ in blocks]
    # 16 more the good tenant never reads: the oldest in DRAM, the first a flood would evict
    cold = [_block(gns, MiB, 100 + i) for i in range(16)]
    assert all(r.status is Status.STORED for r in await good.put(cold))
    await _latencies(good, keys, 50)  # warm-up
    alone = await _latencies(good, keys, gets)
    t0 = time.perf_counter()
    socks = await asyncio.to_thread(_hostile, port)
    setup_s = time.perf_counter() - t0
    hostile = await _latencies(good, keys, gets)
    for s in socks:
        s.close()
    rows = {
        "alone": {"p50_ms": _pct(alone, 50), "p99_ms": _pct(alone, 99)},
        "hostile": {"p50_ms": _pct(hostile, 50), "p99_ms": _pct(hostile, 99)},
    }
    attacks = {}
    load_before = os.getloadavg()
    for name, attack in ATTACKS.items():
        if only and name not in only:
            continue
        ctx: dict = {"good_keys": keys, "extra": {}}
        alone_now = await _latencies(good, keys, gets, [0])  # alone, just before this attack
        floor, floor50 = _pct(alone_now, 99), _pct(alone_now, 50)
        base = _rss(pid)
        try:
            stop = await asyncio.to_thread(attack, ports, ctx)
        except (OSError, AssertionError, KeyError) as exc:  # the attack itself failed: say which
            attacks[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: the attack failed: {exc!r}", file=sys.stderr)
            continue
        await asyncio.sleep(1.0)  # the attack under way
        missed = [0]
        lat = await _latencies(good, keys, gets, missed)
        row = {
            "good_get_misses": missed[0],
            "p50_ms": _pct(lat, 50),
            "p99_ms": _pct(lat, 99),
            "alone_p50_ms": floor50,
            "alone_p99_ms": floor,
            "p50_ratio": _pct(lat, 50) / floor50,
            "p99_ratio": _pct(lat, 99) / floor,
            "admitted": await asyncio.to_thread(_admitted, port),
            "rss_growth_mib": round((_rss(pid) - base) / MiB, 1),
        }
        if name == "reserve":
            row["good_blocks_in_dram"] = (await good.lookup(keys)).names().count("dram")
        if name == "ns_flood":  # data lost: the good tenant's cold blocks, 80 MiB in all, under its share
            row["good_cold_kept"] = (
                f"{sum(t is not None for t in (await good.lookup([h.key for h, _ in cold])).names())}/16"
            )
        if name == "admin_flood":
            row["healthz_ok"] = await asyncio.to_thread(_healthz, ports)
        if name == "admin_parse":
            row["admin_bad_http"] = await asyncio.to_thread(
                _admin_counter, ports, 'tierkv_admin_request_errors_total{kind="bad_http"}'
            )
        await asyncio.to_thread(stop)
        row.update(ctx["extra"])
        attacks[name] = row
    await good.close()
    return {
        "gets_per_phase": gets,
        "block_bytes": MiB,
        "stalled_puts": STALLED,
        "stalled_gets": STALLED,
        "idle_connections": IDLE,
        "hostile_setup_s": round(setup_s, 2),
        "phases": rows,
        "p99_ratio": rows["hostile"]["p99_ms"] / rows["alone"]["p99_ms"],
        "target_p99_ratio": 2.0,
        "attacks": attacks,
        "load_avg_before": load_before,
        "load_avg": os.getloadavg(),
    }


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--gets", type=int, default=1000, help="GETs per phase")
    ap.add_argument("--attacks", default="", help="comma-separated attacks to run (default: all)")
    args = ap.parse_args()
    only = {a for a in args.attacks.split(",") if a}
    unknown = only - set(ATTACKS)
    if unknown:
        ap.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * IDLE), hard))
    with tempfile.TemporaryDirectory() as tmp:
        proc, ports = _start(Path(tmp))
        try:
            res = asyncio.run(_run(ports, proc.pid, args.gets, only))
        finally:
            proc.terminate()
            proc.wait(30)
    p = res["phases"]
    print(f"{'phase':<9} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("alone", "hostile"):
        print(f"{name:<9} {p[name]['p50_ms']:>8.3f} {p[name]['p99_ms']:>8.3f}")
    ok = res["p99_ratio"] <= res["target_p99_ratio"]
    print(f"p99 hostile/alone = {res['p99_ratio']:.2f} (target <= 2.0: {'met' if ok else 'NOT met'})")
    print(
        f"\n{'attack':<14} {'p50 ms':>8} {'p99 ms':>8} {'p50/alone':>9} {'p99/alone':>9} {'admitted':>8} {'RSS +MiB':>8}  other"
    )
    for name, r in res["attacks"].items():
        if "error" in r:
            print(f"{name:<14} attack failed: {r['error']}")
            continue
        shown = (
            "good_blocks_in_dram",
            "healthz_ok",
            "good_get_misses",
            "good_cold_kept",
            "hellos_refused",
            "scrape_kib",
            "scrapes",
            "foreign_vs_absent_auc",
            "admin_bad_http",
            "kernel_unsent_mib",
        )
        other = {k: v for k, v in r.items() if k in shown and v is not None}
        print(
            f"{name:<14} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['p50_ratio']:>9.2f} {r['p99_ratio']:>9.2f} "
            f"{r['admitted']:>5}/20 {r['rss_growth_mib']:>8.1f}  {other or ''}"
        )
    print(f"load average before the attacks {res['load_avg_before']}, after {res['load_avg']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
