"""Sender CPU per GB of the ways the daemon could send a large reply (issue 18, item 2).

One process sends ``--mib`` MiB over loopback, in 256 KiB views, 512 views per ``sendmsg``, to
a receiving child process that reads into one buffer; ``SO_SNDBUF`` 4 MiB as the daemon's.
Modes, interleaved, ``--rounds`` each:

* ``blocking``: a blocking socket, ``sendmsg`` until done (the floor: the raw server's).
* ``loop``: the daemon's sends before ``send_slices``: :class:`rdma.channel.SocketChannel` on an asyncio loop,
  non-blocking ``sendmsg`` and a wait for writability at each full buffer.
* ``worker-poll``: one worker thread per send, non-blocking ``sendmsg`` and a bounded ``poll``
  slice (0.2 s) at each full buffer (the client's sends before they used ``SO_SNDTIMEO``).
* ``worker-sndtimeo``: one worker thread, the socket blocking with ``SO_SNDTIMEO`` (what both ends use now):
  the kernel waits for room inside ``sendmsg``, a stalled peer still returns it within the slice.

CPU is the sending process's (user + system, ``resource.getrusage``) per GB; the table gives
each mode's median and its ratio to ``blocking``, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import select
import socket
import statistics
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rdma.bursts import IOV_MAX, advance  # noqa: E402
from rdma.channel import SocketChannel  # noqa: E402

VIEW = 256 << 10
SNDBUF = 4 << 20


def _receiver(port: int, total: int, rounds: int) -> None:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for _ in range(rounds):
        s = socket.create_connection(("127.0.0.1", port))
        left = total
        while left:
            n = s.recv_into(view[: min(left, len(buf))])
            if not n:
                raise SystemExit("sender closed early")
            left -= n
        s.sendall(b"k")
        s.close()


def _views(total: int) -> list[memoryview]:
    payload = memoryview(bytearray(os.urandom(VIEW)))
    return [payload] * (total // VIEW)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _blocking(sock: socket.socket, views: list[memoryview]) -> None:
    sock.setblocking(True)
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i : i + IOV_MAX])
        i = advance(views, i, n)


def _loop(sock: socket.socket, views: list[memoryview]) -> None:
    async def run() -> None:
        ch = SocketChannel(sock)
        await ch.send_views(views)

    asyncio.run(run())


def _worker_poll(sock: socket.socket, views: list[memoryview], pool: ThreadPoolExecutor) -> None:
    sock.setblocking(False)

    def body() -> None:  # the client's sends before they used SO_SNDTIMEO slices
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        i = 0
        while i < len(views):
            try:
                i = advance(views, i, sock.sendmsg(views[i : i + IOV_MAX], (), socket.MSG_DONTWAIT))
            except BlockingIOError:
                poller.poll(200)

    pool.submit(body).result()


def _worker_sndtimeo(sock: socket.socket, views: list[memoryview], pool: ThreadPoolExecutor) -> None:
    sock.setblocking(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 200_000))

    def body() -> None:
        i = 0
        while i < len(views):
            try:
                n = sock.sendmsg(views[i : i + IOV_MAX])
            except (BlockingIOError, TimeoutError):
                continue  # the slice passed with no room: the owner would check its deadline here
            i = advance(views, i, n)

    pool.submit(body).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    total = args.mib << 20
    modes = ["blocking", "loop", "worker-poll", "worker-sndtimeo"]
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    port = lsock.getsockname()[1]
    n_sends = len(modes) * args.rounds
    pid = os.fork()
    if pid == 0:
        lsock.close()
        _receiver(port, total, n_sends)
        os._exit(0)
    pool = ThreadPoolExecutor(max_workers=1)
    load0 = os.getloadavg()
    per: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            conn, _ = lsock.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            views = _views(total)
            c0, t0 = _cpu(), time.perf_counter()
            if m == "blocking":
                _blocking(conn, views)
            elif m == "loop":
                _loop(conn, views)
            elif m == "worker-poll":
                _worker_poll(conn, views, pool)
            else:
                _worker_sndtimeo(conn, views, pool)
            conn.setblocking(True)
            conn.settimeout(30)
            assert conn.recv(1) == b"k"
            c1, t1 = _cpu(), time.perf_counter()
            per[m].append(((c1 - c0) / (total / 1e9), (total / 1e9) / (t1 - t0)))
            conn.close()
    os.waitpid(pid, 0)
    load1 = os.getloadavg()
    floor = statistics.median(c for c, _ in per["blocking"])
    print("| mode | sender CPU s/GB | / blocking | GB/s |")
    print("|---|---|---|---|")
    rows = []
    for m in modes:
        cpu = statistics.median(c for c, _ in per[m])
        gbs = statistics.median(g for _, g in per[m])
        rows.append({"mode": m, "cpu_s_per_gb": cpu, "ratio": cpu / floor, "gb_s": gbs, "rounds": per[m]})
        print(f"| {m} | {cpu:.3f} | {cpu / floor:.2f} | {gbs:.2f} |")
    print(f"load average (1, 5, 15 min): before {list(load0)}, after {list(load1)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"mib": args.mib, "rounds": args.rounds, "load_avg": [load0, load1], "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
