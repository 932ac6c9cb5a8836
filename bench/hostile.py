"""A well-behaved client's GET latency beside hostile ones (docs/security.md).

One `kvstore serve` daemon on loopback with two tenants. The good tenant GETs 1 MiB blocks
one at a time (kvstore.client.node, checksum-verified) and its p50/p99 latency is measured:
  alone     nothing else connected
  hostile   beside 5 stalled PUTs (each sent 1 of 4 MiB, then nothing), 5 stalled GETs (each
            read 64 KiB of a 4 MiB reply, then nothing) and 1,000 idle authenticated
            connections of the other tenant
Target: p99 beside the hostile clients within 2x of p99 alone. Prints a table and writes
JSON (--json). Bounded: a fixed number of GETs per phase, about a minute in all.

    python bench/hostile.py --json .bench/hostile.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstore import protocol as P  # noqa: E402
from kvstore.block import make_header  # noqa: E402
from kvstore.client.node import ClientConfig, NodeClient  # noqa: E402
from kvstore.keys import Namespace  # noqa: E402
from kvstore.results import Status  # noqa: E402

MiB = 1 << 20
GOOD, BAD = "tok-good-tenant", "tok-bad-tenant1"
NS = Namespace("bench-hostile", "uint8", 16)
IDLE = 1000
STALLED = 5


def _start(tmp: Path) -> tuple[subprocess.Popen, int]:
    (tmp / "tokens").write_text(f"{GOOD} good\n{BAD} bad\n")
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
            return proc, json.loads((tmp / "ports.json").read_text())["data_port"]
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


def _hello(port: int, rcvbuf: int | None = None) -> tuple[socket.socket, str]:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(
        _frame(
            {"op": "HELLO", "rid": 0, "v": P.PROTOCOL_VERSION, "token": BAD, "ns": [P.namespace_to_wire(NS)]}
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
    assert all(r[0] == int(Status.STORED) for r in _reply(s)["res"])
    socks.append(s)
    for i in range(STALLED):  # GETs whose readers stop after 64 KiB
        g, _ = _hello(port, rcvbuf=64 << 10)
        g.sendall(_frame({"op": "GET", "rid": 1, "keys": [big[i][0].key.raw]}))
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


async def _latencies(client: NodeClient, keys, n: int) -> list[float]:
    buf = np.empty(MiB, dtype=np.uint8)
    out = []
    rng = random.Random(7)
    for _ in range(n):
        k = keys[rng.randrange(len(keys))]
        t0 = time.perf_counter()
        [r] = await client.get_into([k], [buf])
        out.append(time.perf_counter() - t0)
        assert r.status is Status.HIT, r
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


async def _run(port: int, gets: int) -> dict:
    good = NodeClient(
        f"127.0.0.1:{port}", ClientConfig(token=GOOD, namespaces=(NS,), pool_size=1, op_timeout_s=10)
    )
    gns = await good.tenant_namespace(NS)
    blocks = [_block(gns, MiB, i) for i in range(64)]
    assert all(r.status is Status.STORED for r in await good.put(blocks))
    keys = [h.key for h, _ in blocks]
    await _latencies(good, keys, 50)  # warm-up
    alone = await _latencies(good, keys, gets)
    t0 = time.perf_counter()
    socks = await asyncio.to_thread(_hostile, port)
    setup_s = time.perf_counter() - t0
    hostile = await _latencies(good, keys, gets)
    for s in socks:
        s.close()
    await good.close()
    rows = {
        "alone": {"p50_ms": _pct(alone, 50), "p99_ms": _pct(alone, 99)},
        "hostile": {"p50_ms": _pct(hostile, 50), "p99_ms": _pct(hostile, 99)},
    }
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
    }


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--gets", type=int, default=1000, help="GETs per phase")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * IDLE), hard))
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = _start(Path(tmp))
        try:
            res = asyncio.run(_run(port, args.gets))
        finally:
            proc.terminate()
            proc.wait(30)
    p = res["phases"]
    print(f"{'phase':<9} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("alone", "hostile"):
        print(f"{name:<9} {p[name]['p50_ms']:>8.3f} {p[name]['p99_ms']:>8.3f}")
    ok = res["p99_ratio"] <= res["target_p99_ratio"]
    print(f"p99 hostile/alone = {res['p99_ratio']:.2f} (target <= 2.0: {'met' if ok else 'NOT met'})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
