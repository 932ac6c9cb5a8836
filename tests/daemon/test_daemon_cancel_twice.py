"""A connection cancelled twice (two quick revokes; a stop's idle cancel on top of its grace
period's; a failed reply send's ``on_fail`` during a cancelled receive) still waits for every
worker that touches its buffers and still ends every reply before its slots go back; and a
send in slices hands its worker back after one slice that waited, whatever the budget."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from kvstore.daemon.logs import RateLimitedLog
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.replies import ReplyQueue
from rdma.bursts import send_slices
from rdma.channel import SocketChannel

MiB = 1 << 20


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


async def test_a_worker_is_waited_for_even_when_its_transfer_is_cancelled_twice():
    a, b = _tcp_pair()
    pool = ThreadPoolExecutor(1)
    release = threading.Event()
    finished = threading.Event()

    def copying() -> None:  # a worker still moving bytes when its await is cancelled
        release.wait(5)
        finished.set()

    ch = SocketChannel(a, offload=pool)
    task = asyncio.create_task(ch._in_worker(copying))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()  # e.g. on_fail: the reply send failed on the socket shut down
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for its worker
    release.set()
    await asyncio.wait({task})
    assert task.cancelled()
    assert finished.is_set()
    ch.close()
    b.close()
    pool.shutdown()


async def test_close_of_the_replies_cancelled_again_returns_only_when_the_sender_has_stopped():
    a, b = _tcp_pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    pool = ThreadPoolExecutor(1)
    ch = SocketChannel(a, offload=pool, send_slice_s=2.0)  # the sender stays in its worker
    metrics = DaemonMetrics(lambda: {})
    ended: list[bool] = []
    q = ReplyQueue(
        ch, 2, 30.0, metrics, RateLimitedLog(logging.getLogger("t")), "peer", lambda d: None, lambda: None
    )
    payload = bytes(16 * MiB)
    q.send({"op": "GET"}, [payload], done=ended.append)  # the peer never reads: the sender waits
    await asyncio.sleep(0.1)
    assert q.pending == 1
    closer = asyncio.create_task(q.close())
    await asyncio.sleep(0)  # close has cancelled the sender and waits for it
    closer.cancel()  # a second revoke
    await asyncio.wait({closer})
    assert q._task is None  # no byte of the reply moves after close ended
    assert ended == [False]
    ch.close()
    b.close()
    pool.shutdown()


def test_a_send_in_slices_returns_after_one_slice_that_waited_for_a_slow_reader():
    """The reader takes 256 KiB every 10 ms (slow, but reading): the worker returns after the
    first sendmsg that waited its slice out, not at the budget (here 30 s, more than the whole
    transfer takes)."""
    a, b = _tcp_pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 << 10)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0.02))
    total = 12 * MiB
    views = [memoryview(bytes(1 * MiB)) for _ in range(total // MiB)]
    stop = threading.Event()
    got = [0]

    def slow_reader() -> None:
        buf = bytearray(256 << 10)
        while not stop.is_set() and got[0] < total:
            n = b.recv_into(buf)
            if not n:
                return
            got[0] += n
            stop.wait(0.01)

    t = threading.Thread(target=slow_reader)
    t.start()
    try:
        i, sent = send_slices(a, views, 0, 30.0)
        assert sent > 0
        assert i < len(views) and sent < total  # handed back before the transfer's end
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()


def _timeval(s: float) -> bytes:
    import struct

    usec = int(s * 1e6)
    return struct.pack("ll", usec // 1000000, usec % 1000000)
