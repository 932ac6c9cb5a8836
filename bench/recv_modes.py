"""The receiver's CPU per GB of one streamed batch, by how it receives (rdma/bursts.py
``recv_landing``, the client's offloaded receive), beside a plain blocking ``recv_into``.

A sender process writes ``--mib`` MiB per round over loopback (blocking ``sendall``); this
process receives them into ``--view-kib`` KiB views, interleaved rounds, in each mode:

  raw        blocking recv_into of the whole buffer (the raw client of bench/peers.py)
  landing    recv_landing on a blocking socket (SO_RCVTIMEO), views per call as Landing
             picks, xxh3 of each view as it lands (the client's receive)
  nohash     the same without the digests (what the checksum costs)
  poll-512   recv_landing on a non-blocking socket (MSG_DONTWAIT + poll per wait) with 512
             views per call (the client's receive before 2026-12-01 night)

Prints receiver CPU s/GB (median of rounds) and its ratio to raw; the ratios count.

    python bench/recv_modes.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xxhash import xxh3_64  # noqa: E402

from rdma.bursts import IOV_MAX, Landing, recv_landing  # noqa: E402

MODES = ("raw", "landing", "nohash", "poll-512")


def sender(port: int, nbytes: int, rounds: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    data = memoryview(os.urandom(nbytes))
    for _ in range(rounds):
        if s.recv(1) != b"g":
            return
        s.sendall(data)


def receive(sock: socket.socket, mode: str, views: list[memoryview], flat: memoryview) -> None:
    if mode == "raw":
        got = 0
        while got < flat.nbytes:
            got += sock.recv_into(flat[got:])
        return
    sock.setblocking(mode != "poll-512")
    land = Landing(list(views), None if mode == "nohash" else xxh3_64)
    if mode == "poll-512":
        land.per_call = IOV_MAX
    while not land.done:
        recv_landing(sock, land, 0.2)
    sock.setblocking(True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--view-kib", type=int, default=256)
    ap.add_argument("--sender", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sender:
        sender(*a.sender)
        return 0
    nbytes = a.mib << 20
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    total = (a.rounds + 1) * len(MODES)
    port = srv.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--sender", str(port), str(nbytes), str(total)])
    sock, _ = srv.accept()
    buf = bytearray(nbytes)
    flat = memoryview(buf)
    step = a.view_kib << 10
    views = [flat[i : i + step] for i in range(0, nbytes, step)]
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for rnd in range(a.rounds + 1):  # round 0 warms up and is not counted
        for mode in MODES:
            sock.sendall(b"g")
            c0 = time.process_time()
            receive(sock, mode, views, flat)
            if rnd:
                cpu[mode].append((time.process_time() - c0) / (nbytes / 1e9))
    proc.wait()
    raw = statistics.median(cpu["raw"])
    print(f"load average {os.getloadavg()}; {a.mib} MiB in {a.view_kib} KiB views, {a.rounds} rounds")
    print("| mode | receiver CPU s/GB (median) | / raw | rounds |")
    print("|---|---|---|---|")
    for m in MODES:
        med = statistics.median(cpu[m])
        print(f"| {m} | {med:.3f} | {med / raw:.2f} | {' '.join(f'{x:.3f}' for x in cpu[m])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
