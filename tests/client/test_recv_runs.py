"""The client's blocking receive (rdma/bursts.py ``recv_landing`` on a blocking socket: the
kernel waits inside ``recvmsg`` with SO_RCVTIMEO): every byte lands in its view with its
digest whatever the sender's pace, a short tail is received, a sender that stops mid-stream
makes the call return (the caller then waits on its loop), and the socket's SO_RCVLOWAT is 1
throughout, so the loop's readiness waits see a reply header of a few bytes (a wait for
larger runs stalled one-block GETs: docs/benchmarks.md, the one-off experiments)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import xxhash

from rdma.bursts import Landing, recv_landing


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_paced_stream_lands_whole_with_digests_and_leaves_lowat_at_one():
    data = np.random.default_rng(5).integers(0, 256, (3 << 20) + 1000, dtype=np.uint8).tobytes()
    cuts = [0, 100, 70_000, 1 << 20, (1 << 20) + 5, (5 << 19), len(data) - 10, len(data)]
    a, b = socket.socketpair()
    b.setblocking(True)

    def send():
        for i, j in zip(cuts, cuts[1:]):
            a.sendall(data[i:j])
            time.sleep(0.05)  # the sender's pace: the receiver must not wait for a full run

    t = threading.Thread(target=send)
    t.start()
    buf = bytearray(len(data))
    sizes = [256 << 10] * 12 + [len(data) - 12 * (256 << 10)]
    views, at = [], 0
    for n in sizes:
        views.append(memoryview(buf)[at : at + n])
        at += n
    land = Landing(views, xxhash.xxh3_64)
    calls = 0
    while not land.done:
        recv_landing(b, land, 0.2)
        calls += 1
        assert _lowat(b) == 1
    t.join()
    assert bytes(buf) == data and calls >= 1
    off = 0
    for v, d in zip(views, land.digests, strict=True):
        assert d == xxhash.xxh3_64_intdigest(data[off : off + v.nbytes])
        off += v.nbytes
    a.close()
    b.close()


def test_a_sender_that_stops_mid_stream_returns_the_call_with_what_came():
    a, b = socket.socketpair()
    b.setblocking(True)
    a.sendall(b"x" * 5000)  # less than a run, far less than the landing
    buf = bytearray(4 << 20)
    land = Landing([memoryview(buf)], xxhash.xxh3_64)
    got = recv_landing(b, land, 0.1)
    assert 0 < got <= 5000 and not land.done and _lowat(b) == 1
    assert recv_landing(b, land, 0.1) == 5000 - got  # nothing more: the call returns
    assert _lowat(b) == 1
    a.close()
    b.close()
