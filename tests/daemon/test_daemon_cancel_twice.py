"""A connection cancelled twice (two quick revokes; a stop's idle cancel on top of its grace
period's; a failed reply send's ``on_fail`` during a cancelled receive) still waits for every
worker that touches its buffers and still ends every reply before its slots go back."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from kvstore.daemon.logs import RateLimitedLog
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.replies import ReplyQueue
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
