"""Fetch and store of a whole prefix: tierkv beside the raw socket, Redis and Mooncake Store.

One client process (this one), blocks held by one server process on loopback, fetched into
preallocated buffers and stored from them. Per block size (2 MiB x 256, 32 MiB x 32,
256 KiB x 2,048) and round (interleaved, ``--rounds``), each peer fetches and stores the whole
prefix once:

  raw-1 / raw-4    blocking sendall -> recv_into, 1 or 4 connections (the limit for any TCP store)
  tierkv-1 / -4    ``kvstore serve`` (DRAM only), NodeClient get_into / put with streams=1 or 4
                   (every payload checksum-verified by the client)
  tierkv:P-1       with ``--policies P,...``: one more daemon per eviction policy P, measured
                   interleaved with the rest (the eviction order's per-op cost; each ratio
                   is to tierkv-1, which runs the default policy)
  redis            redis-server (no persistence), redis-py pipelined GET / SET (copied into
                   the same buffers)
  mooncake         Mooncake Store over its TCP protocol (bench/peers_mooncake.py in the peers
                   venv, ``make peers``), batch_get_into / batch_put_from registered buffers,
                   inside a private network namespace (``unshare --net``, only lo up); every
                   fetched block is compared with what was stored, failures reported

GB/s per peer (median of rounds), its ratio to raw-1 (raw-4 for the striped tierkv), and the
client's and server's CPU seconds per GB. Absent peers are skipped with a note. JSON with
every round and the load average (``--json``).

    python bench/peers.py --json docs/results/peers.json
    python bench/peers.py --peers redis --sizes 2048 --policies lru --rounds 3   # policy cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
import numpy as np
from common import REPO, cpu_s

MiB = 1 << 20
KiB = 1 << 10
PEERS_PY = REPO / ".peers" / "bin" / "python"
SIZES = [(2 * MiB, 256), (32 * MiB, 32), (256 * KiB, 2048)]
_REQ = struct.Struct(">cQQ")


# ------------------------------------------------------------------ raw socket


def raw_server(size: int) -> None:
    """Serves ``size`` bytes: ``G off n`` sends them, ``P off n`` receives them (then b"k")."""
    buf = bytearray(os.urandom(size))
    mv = memoryview(buf)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    print(srv.getsockname()[1], flush=True)

    def serve(c: socket.socket) -> None:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            hdr = c.recv(_REQ.size, socket.MSG_WAITALL)
            if len(hdr) < _REQ.size:
                return
            op, off, n = _REQ.unpack(hdr)
            if op == b"G":
                c.sendall(mv[off : off + n])
            else:
                got = 0
                while got < n:
                    got += c.recv_into(mv[off + got : off + n])
                c.sendall(b"k")

    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


class Raw:
    def __init__(self, size: int, conns: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-server", str(size)], stdout=subprocess.PIPE
        )
        port = int(self.proc.stdout.readline())
        self.socks = []
        for _ in range(conns):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.pid = self.proc.pid

    def _part(self, s: socket.socket, op: bytes, mv: memoryview, off: int) -> None:
        s.sendall(_REQ.pack(op, off, mv.nbytes))
        if op == b"G":
            got = 0
            while got < mv.nbytes:
                got += s.recv_into(mv[got:])
        else:
            s.sendall(mv)
            s.recv(1)

    def run(self, op: bytes, flat: np.ndarray) -> None:
        mv = memoryview(flat).cast("B")
        k = len(self.socks)
        step = -(-mv.nbytes // k)
        ts = [
            threading.Thread(target=self._part, args=(s, op, mv[i * step : (i + 1) * step], i * step))
            for i, s in enumerate(self.socks)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return 0

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.proc.kill()
        self.proc.wait()


# ------------------------------------------------------------------ tierkv


def _headers(src: np.ndarray, seed: int):
    from kvstore.block import make_header
    from kvstore.keys import Namespace

    ns = Namespace("bench-peers", "uint8", 16)
    keys = ns.block_keys([seed] + list(range(16 * len(src) - 1)))
    out = []
    for k, row in zip(keys, src):
        out.append(
            make_header(
                key=k,
                parent=ns.id,
                namespace=ns.id,
                tokens=[0] * 16,
                dtype="uint8",
                shape=[row.nbytes],
                payload=row,
            )
        )
    return ns, out


class Tierkv:
    def __init__(
        self, tmp: Path, size: int, count: int, src: np.ndarray, streams: list[int], policy: str = ""
    ) -> None:
        slab = max(size, 2 * MiB)
        cap = 2 * size * count + 8 * slab
        self.daemon = common.start_daemon(
            tmp,
            dram={"capacity": f"{cap // MiB}MiB", "slab_size": f"{slab // MiB}MiB", "prefault": True},
            server={"max_frame": f"{max(64, 2 * slab // MiB + 1)}MiB"},
            **({"eviction": {"policy": policy}} if policy else {}),
        )
        self.addr = self.daemon.addr
        self.pid = self.daemon.proc.pid
        self.src = src
        self.ns, self.fetch_hdrs = _headers(src, 1)
        self.fetch_keys = [h.key for h in self.fetch_hdrs]
        _, self.store_hdrs = _headers(src, 2)
        self.streams = streams
        self.clients: dict[int, object] = {}

    async def start(self) -> None:
        from kvstore.client.node import ClientConfig, NodeClient

        for s in self.streams:
            cfg = ClientConfig(namespaces=(self.ns,), pool_size=max(s, 1), streams=s, op_timeout_s=120)
            self.clients[s] = NodeClient(self.addr, cfg)
        c = self.clients[self.streams[0]]
        res = await c.put(list(zip(self.fetch_hdrs, self.src)))
        assert all(r.status.ok for r in res) and len(res) == len(self.src), res[:3]

    async def fetch(self, streams: int, dst: np.ndarray) -> int:
        from kvstore.client.read import get_into
        from kvstore.results import Status

        got = await get_into(self.clients[streams], self.fetch_keys, list(dst))
        return len(got) - got.count_of(Status.HIT)  # one GetResults: no record per block

    async def store(self, streams: int, _dst: np.ndarray) -> int:
        res = await self.clients[streams].put(list(zip(self.store_hdrs, self.src)))
        return sum(not r.status.ok for r in res)

    async def after_store(self, streams: int) -> None:
        await self.clients[streams].delete([h.key for h in self.store_hdrs])

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()
        self.daemon.stop()


# ------------------------------------------------------------------ redis


class Redis:
    def __init__(self, src: np.ndarray) -> None:
        import redis

        self.port = common.free_port()
        self.proc = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        self.pid = self.proc.pid
        self.r = None
        for _ in range(100):
            try:
                self.r = redis.Redis(port=self.port)
                self.r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        self.src = src
        self.fkeys = [f"f{i}" for i in range(len(src))]
        self.skeys = [f"s{i}" for i in range(len(src))]
        self._set(self.fkeys)

    def _set(self, keys) -> int:
        p = self.r.pipeline(transaction=False)
        for k, row in zip(keys, self.src):
            p.set(k, memoryview(row))
        return sum(not ok for ok in p.execute())

    def fetch(self, dst: np.ndarray) -> int:
        p = self.r.pipeline(transaction=False)
        for k in self.fkeys:
            p.get(k)
        bad = 0
        for row, v in zip(dst, p.execute()):
            if v is None or len(v) != row.nbytes:
                bad += 1
                continue
            row[:] = np.frombuffer(v, np.uint8)
        return bad

    def store(self, _dst: np.ndarray) -> int:
        return self._set(self.skeys)

    def after_store(self) -> None:
        self.r.delete(*self.skeys)

    def close(self) -> None:
        self.r.flushall()
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------ mooncake (its own venv, netns)


class Mooncake:
    """bench/peers_mooncake.py under ``unshare --net`` (only lo up), driven over its stdin."""

    def __init__(self, size: int, count: int) -> None:
        inner = f"ip link set lo up && exec {PEERS_PY} {REPO / 'bench' / 'peers_mooncake.py'} {size} {count}"
        # its transfer engine wants a non-loopback address unless told one; at 256 KiB its default
        # TCP admission timeout drops parts of large batches (error -800)
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_TCP_ADMISSION_TIMEOUT_MS": "20000"}
        self.proc = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", inner],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = json.loads(self.proc.stdout.readline())
        if not ready.get("ready"):
            raise RuntimeError(f"mooncake did not start: {ready}")

    def call(self, op: str) -> dict:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.call("quit")
        except Exception:
            pass
        self.proc.kill()
        self.proc.wait(30)


def mooncake_absent() -> str | None:
    if not PEERS_PY.exists():
        return "no peers venv (run `make peers`)"
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare for a private network namespace"
    return None


# ------------------------------------------------------------------ driver


def _timed(fn, server_pid: int | None) -> tuple[float, float, float, int]:
    """(seconds, client CPU s, server CPU s, failures) of the blocking call ``fn()``."""
    srv0 = cpu_s(server_pid) if server_pid else 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    bad = fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, (cpu_s(server_pid) - srv0 if server_pid else 0.0), bad


async def _atimed(coro_fn, server_pid: int) -> tuple[float, float, float, int]:
    srv0 = cpu_s(server_pid)
    c0, t0 = time.process_time(), time.perf_counter()
    bad = await coro_fn()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, cpu_s(server_pid) - srv0, bad


async def bench_size(
    size: int, count: int, rounds: int, peers: set[str], policies: list[str], notes: list[str]
) -> list[dict]:
    nbytes = size * count
    src = np.random.default_rng(size).integers(0, 256, (count, size), dtype=np.uint8)
    dst = np.ones((count, size), np.uint8)  # touched: no first-fetch page faults
    samples: dict[tuple[str, str], list[tuple]] = {}
    runners: dict[str, tuple] = {}  # name -> (fetch, store, after_store)
    closers = []
    kvs: list[Tierkv] = []
    with tempfile.TemporaryDirectory() as td:
        try:
            for k in (1, 4):
                raw = Raw(nbytes, k)
                closers.append(raw.close)
                runners[f"raw-{k}"] = (
                    lambda raw=raw: _timed(lambda: raw.run(b"G", dst), raw.pid),
                    lambda raw=raw: _timed(lambda: raw.run(b"P", src), raw.pid),
                    None,
                )
            for policy in ["", *policies]:
                kv = Tierkv(
                    Path(td) / (policy or "default"), size, count, src, [1] if policy else [1, 4], policy
                )
                kvs.append(kv)
                await kv.start()
                for s in kv.streams:
                    runners[f"tierkv{':' + policy if policy else ''}-{s}"] = (
                        lambda s=s, kv=kv: _atimed(lambda: kv.fetch(s, dst), kv.pid),
                        lambda s=s, kv=kv: _atimed(lambda: kv.store(s, dst), kv.pid),
                        lambda s=s, kv=kv: kv.after_store(s),
                    )
            if "redis" in peers:
                rd = Redis(src)
                closers.append(rd.close)
                runners["redis"] = (
                    lambda: _timed(lambda: rd.fetch(dst), rd.pid),
                    lambda: _timed(lambda: rd.store(dst), rd.pid),
                    rd.after_store,
                )
            if "mooncake" in peers:
                try:
                    mc = Mooncake(size, count)
                    closers.append(mc.close)

                    def mc_op(op):
                        r = mc.call(op)
                        return r["s"], r["client_cpu"], r["server_cpu"], r["failures"]

                    runners["mooncake"] = (
                        lambda: mc_op("fetch"),
                        lambda: mc_op("store"),
                        lambda: mc.call("clean"),
                    )
                except Exception as exc:  # reported, not hidden
                    notes.append(f"mooncake at {size // KiB} KiB: {exc}")
            for rnd in range(-1, rounds):  # round -1 warms every peer up and is not counted
                for name, (fetch, store, after) in runners.items():
                    for op, fn in (("fetch", fetch), ("store", store)):
                        got = fn()
                        if asyncio.iscoroutine(got):
                            got = await got
                        if rnd >= 0:
                            samples.setdefault((name, op), []).append(got)
                        if op == "store" and after is not None:
                            a = after()
                            if asyncio.iscoroutine(a):
                                await a
                print(f"{size // KiB} KiB x{count} round {rnd + 1}/{rounds} done", flush=True)
        finally:
            for kv in kvs:
                await kv.close()
            for c in closers:
                c()
    rows = []
    for (name, op), ss in samples.items():
        secs = statistics.median(s[0] for s in ss)
        rows.append(
            {
                "block_kib": size // KiB,
                "blocks": count,
                "peer": name,
                "op": op,
                "gbps": nbytes / secs / 1e9,
                "client_cpu_s_per_gb": statistics.median(s[1] for s in ss) / (nbytes / 1e9),
                "server_cpu_s_per_gb": statistics.median(s[2] for s in ss) / (nbytes / 1e9),
                "failures": sum(s[3] for s in ss),
                "rounds_s": [round(s[0], 4) for s in ss],
            }
        )
    base = {(r["op"], r["peer"]): r["gbps"] for r in rows}
    for r in rows:
        ref = (
            "raw-4"
            if r["peer"].endswith("-4")
            else "tierkv-1"
            if r["peer"].startswith("tierkv:")
            else "raw-1"
        )
        r["vs_raw"] = r["gbps"] / base[(r["op"], ref)]
        r["raw_ref"] = ref
    return rows


def table(rows: list[dict]) -> str:
    """One row per block size, op and peer: GB/s, its ratio to its reference (raw-1, raw-4 for
    4 streams, tierkv-1 for a policy), CPU s per GB of client and server beside the raw's."""
    by = {(r["block_kib"], r["op"], r["peer"]): r for r in rows}

    def row(r: dict) -> tuple:
        kib = r["block_kib"]
        raw = by[(kib, r["op"], "raw-4" if r["raw_ref"] == "raw-4" else "raw-1")]
        cpu = [f"{r[k]:.2f} ({raw[k]:.2f})" for k in ("client_cpu_s_per_gb", "server_cpu_s_per_gb")]
        blocks = f"{r['blocks']} x {kib // 1024} MiB" if kib >= 1024 else f"{r['blocks']} x {kib} KiB"
        return (
            blocks,
            r["op"],
            r["peer"],
            f"{r['gbps']:.2f}",
            f"{r['vs_raw']:.2f} ({r['raw_ref']})",
            *cpu,
            r["failures"],
        )

    header = [
        "blocks",
        "op",
        "peer",
        "GB/s",
        "/ ref",
        "client CPU s/GB (raw's)",
        "server CPU s/GB (raw's)",
        "failures",
    ]
    return common.md_table(header, [row(r) for r in rows])


async def amain(args) -> int:
    notes: list[str] = []
    peers = set(args.peers.split(","))
    if "redis" in peers and not shutil.which("redis-server"):
        notes.append("redis skipped: no redis-server on PATH")
        peers.discard("redis")
    if "redis" in peers:
        try:
            import redis  # noqa: F401
        except ImportError:
            notes.append("redis skipped: redis-py not installed")
            peers.discard("redis")
    if "mooncake" in peers and (why := mooncake_absent()):
        notes.append(f"mooncake skipped: {why}")
        peers.discard("mooncake")
    load_before = common.loadavg()
    print(f"load average (1, 5, 15 min) before: {load_before}", flush=True)
    rows = []
    sizes = [s for s in SIZES if str(s[0] // KiB) in args.sizes.split(",")] if args.sizes else SIZES
    policies = [p for p in args.policies.split(",") if p]
    for size, count in sizes:
        rows += await bench_size(size, count, args.rounds, peers, policies, notes)
    load = {"before": load_before, "after": common.loadavg()}
    doc = {
        "python": sys.version.split()[0],
        "rounds": args.rounds,
        "load_avg": load,
        "notes": notes,
        "rows": rows,
    }
    print()
    print(table(rows))
    for n in notes:
        print("note:", n)
    print(f"load average (1, 5, 15 min): before {load['before']}, after {load['after']}")
    common.write_json(args.json, doc)
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--raw-server":
        raw_server(int(sys.argv[2]))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peers", default="redis,mooncake", help="besides raw and tierkv")
    ap.add_argument("--sizes", default="", help="block sizes in KiB to run (default all: 2048,32768,256)")
    ap.add_argument("--policies", default="", help="eviction policies, one more daemon each (tierkv:P-1)")
    return asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
