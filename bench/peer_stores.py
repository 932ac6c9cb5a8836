"""The stores bench/peers.py times, each behind the same small interface: the raw socket
(``raw_server`` in a process of its own: ``python bench/peer_stores.py --raw-server SIZE``),
tierkv (a ``kvstore serve`` daemon and NodeClients), Redis (redis-server, redis-py) and Mooncake
Store (bench/peers_mooncake.py in the peers venv, inside a private network namespace). Each
holds a whole prefix to fetch and stores one; the driver times them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import common
import numpy as np
from common import REPO
from daemonutil import stop_process

MiB = 1 << 20
PEERS_PY = REPO / ".peers" / "bin" / "python"
_REQ = struct.Struct(">cQQ")
_PROC_WAIT_S = 300.0  # a client process's start, or one op of it, at the most


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


def raw_part(s: socket.socket, op: bytes, mv: memoryview, off: int) -> int:
    """Fetch (``op`` b"G") or store (b"P") the raw server's bytes ``[off, off + len(mv))``."""
    s.sendall(_REQ.pack(op, off, mv.nbytes))
    if op == b"G":
        got = 0
        while got < mv.nbytes:
            got += s.recv_into(mv[got:])
    else:
        s.sendall(mv)
        s.recv(1)
    return 0


class Raw:
    def __init__(self, size: int, conns: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-server", str(size)], stdout=subprocess.PIPE
        )
        port = int(self.proc.stdout.readline())
        self.addr = f"127.0.0.1:{port}"
        self.socks = []
        for _ in range(conns):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.pid = self.proc.pid

    def run(self, op: bytes, flat: np.ndarray) -> None:
        mv = memoryview(flat).cast("B")
        k = len(self.socks)
        step = -(-mv.nbytes // k)
        ts = [
            threading.Thread(target=raw_part, args=(s, op, mv[i * step : (i + 1) * step], i * step))
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
    """A ``kvstore serve`` daemon under ``tmp`` holding the prefix ``src`` with DRAM for
    ``copies`` of it (2: its copy and the one a store writes; 3 with client processes, which
    store their own), or, with ``addr``, clients of a daemon already there. ``seeds``: the
    first token of the fetched and the stored prefix (other seeds, other keys)."""

    def __init__(
        self,
        tmp: Path | None,
        size: int,
        count: int,
        src: np.ndarray,
        streams: list[int],
        policy: str = "",
        seeds: tuple[int, int] = (1, 2),
        addr: str | None = None,
        copies: int = 2,
    ) -> None:
        self.daemon = None
        if addr is None:
            slab = max(size, 2 * MiB)
            cap = copies * size * count + 8 * slab
            self.daemon = common.start_daemon(
                tmp,
                dram={"capacity": f"{cap // MiB}MiB", "slab_size": f"{slab // MiB}MiB", "prefault": True},
                server={"max_frame": f"{max(64, 2 * slab // MiB + 1)}MiB"},
                **({"eviction": {"policy": policy}} if policy else {}),
            )
            addr = self.daemon.addr
        self.addr = addr
        self.pid = self.daemon.proc.pid if self.daemon else None
        self.src = src
        self.ns, self.fetch_hdrs = _headers(src, seeds[0])
        self.fetch_keys = [h.key for h in self.fetch_hdrs]
        _, self.store_hdrs = _headers(src, seeds[1])
        self.streams = streams
        self.clients: dict[int, object] = {}

    async def start(self) -> None:
        from kvstore.client.config import ClientConfig
        from kvstore.client.node import NodeClient

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
        if self.daemon:
            self.daemon.stop()


# ------------------------------------------------------------------ k client processes


def _client_proc(kind: str, addr: str, size: int, count: int, i: int, k: int, barrier, pipe) -> None:
    """One of ``k`` client processes: blocks ``[i*count/k, (i+1)*count/k)`` of the prefix over
    a connection of its own (raw: its range of the raw server's bytes; tierkv: its own blocks,
    stored before it says ready). Each command waits at ``barrier`` for the others, then
    answers (seconds, CPU seconds, failures)."""
    n = count // k
    if kind == "raw":
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mv = memoryview(np.ones(n * size, np.uint8)).cast("B")
        run = {
            "fetch": lambda: raw_part(sock, b"G", mv, i * n * size),
            "store": lambda: raw_part(sock, b"P", mv, i * n * size),
            "after": lambda: 0,
        }
    else:
        import asyncio

        src = np.random.default_rng(size + i).integers(0, 256, (n, size), dtype=np.uint8)
        dst = src  # a fetch writes the bytes it stored back: one buffer, not two
        kv = Tierkv(None, size, n, src, [1], seeds=(1000 * i + 1, 1000 * i + 2), addr=addr)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(kv.start())
        run = {
            "fetch": lambda: loop.run_until_complete(kv.fetch(1, dst)),
            "store": lambda: loop.run_until_complete(kv.store(1, dst)),
            "after": lambda: loop.run_until_complete(kv.after_store(1)),
        }
    pipe.send("ready")
    while (cmd := pipe.recv()) != "quit":
        barrier.wait(_PROC_WAIT_S)  # a sibling that died breaks it: this one exits too
        c0, t0 = time.process_time(), time.perf_counter()
        bad = run[cmd]() or 0
        pipe.send((time.perf_counter() - t0, time.process_time() - c0, bad))


class Procs:
    """``k`` client processes (:func:`_client_proc`) of ``kind`` ("raw" or "tierkv") against the
    server at ``addr``, each with ``count / k`` blocks; every op starts in all of them at once
    and takes as long as the slowest."""

    def __init__(self, kind: str, addr: str, size: int, count: int, k: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # the parent runs an event loop and threads: no fork
        barrier = ctx.Barrier(k)
        self.pipes, self.procs = [], []
        for i in range(k):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_client_proc, args=(kind, addr, size, count, i, k, barrier, theirs), daemon=True
            )
            p.start()
            self.pipes.append(mine)
            self.procs.append(p)
        for pipe in self.pipes:
            if not pipe.poll(_PROC_WAIT_S) or pipe.recv() != "ready":
                raise RuntimeError(f"a {kind} client process did not start")

    def run(self, cmd: str) -> tuple[float, float, int]:
        """(seconds of the slowest, CPU seconds of all, failures of all) of ``cmd``;
        RuntimeError when a client process has not answered within ``_PROC_WAIT_S``."""
        for pipe in self.pipes:
            pipe.send(cmd)
        got = []
        for i, pipe in enumerate(self.pipes):
            if not pipe.poll(_PROC_WAIT_S):
                raise RuntimeError(f"client process {i} did not answer {cmd!r} within {_PROC_WAIT_S:.0f} s")
            got.append(pipe.recv())
        return max(g[0] for g in got), sum(g[1] for g in got), sum(g[2] for g in got)

    def close(self) -> None:
        for pipe, p in zip(self.pipes, self.procs):
            with contextlib.suppress(OSError):
                pipe.send("quit")
            p.join(10)
            if p.is_alive():
                p.kill()


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
        stop_process(self.proc, 10)


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


if __name__ == "__main__" and sys.argv[1:2] == ["--raw-server"]:
    raw_server(int(sys.argv[2]))
