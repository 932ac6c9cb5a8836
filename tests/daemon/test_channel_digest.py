"""A received payload is hashed by the thread that copied its last bytes (SocketChannel.recv_into's
``then``), and a GET still verifies every payload against its header's checksum with it."""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.block import check_block, checksum
from kvstore.results import Status
from rdma.channel import OFFLOAD_MIN, SocketChannel


def _digest_and_thread(seen: list[str]):
    def then(mv: memoryview) -> int:
        seen.append(threading.current_thread().name)
        return checksum(mv)

    return then


async def _receive(
    size: int, pool: ThreadPoolExecutor | None
) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
    a_sock, b_sock = socket.socketpair()
    a, b = SocketChannel(a_sock), SocketChannel(b_sock, offload=pool)
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    send = asyncio.ensure_future(a.send([payload]))
    dst = np.zeros(size, np.uint8)
    seen: list[str] = []
    digest = await b.recv_into(dst, _digest_and_thread(seen))
    await send
    a.close()
    b.close()
    return payload, dst, digest, seen


async def test_an_offloaded_receive_hashes_in_the_worker_that_copied_the_bytes():
    pool = ThreadPoolExecutor(2, thread_name_prefix="copy-test")
    try:
        payload, dst, digest, seen = await _receive(3 << 20, pool)
    finally:
        pool.shutdown()
    assert (dst == payload).all()
    assert digest == checksum(payload)
    assert len(seen) == 1 and seen[0].startswith("copy-test"), seen  # once, off the loop thread


async def test_a_receive_on_the_loop_hashes_there_and_without_then_returns_none():
    small = OFFLOAD_MIN // 2
    pool = ThreadPoolExecutor(1, thread_name_prefix="copy-test")
    try:
        payload, dst, digest, seen = await _receive(small, pool)  # below the offload size
    finally:
        pool.shutdown()
    assert digest == checksum(payload) and seen == [threading.current_thread().name]
    a_sock, b_sock = socket.socketpair()
    a, b = SocketChannel(a_sock), SocketChannel(b_sock)
    await a.send([b"xyz"])
    buf = bytearray(3)
    assert await b.recv_into(buf) is None and buf == b"xyz"
    a.close()
    b.close()


def test_a_digest_handed_in_is_checked_against_the_header(ns, blocks_of):
    [(hdr, payload)] = blocks_of(ns, 1, 4096)
    mv = memoryview(payload)
    assert check_block(hdr, hdr.key, None, checksum(mv)) is Status.HIT
    assert check_block(hdr, hdr.key, None, checksum(mv) ^ 1) is Status.CORRUPT


async def test_a_reader_stays_registered_between_waits_wakes_only_on_input_and_goes_at_close():
    """The read waits share one registration (no epoll_ctl per wait); a stale readiness
    callback (queued before the bytes were read) must not wake a waiter of ``readable()``, or
    the daemon would take an idle connection's silence for a stalled transfer."""
    loop = asyncio.get_running_loop()
    a_sock, b_sock = socket.socketpair()
    a, b = SocketChannel(a_sock), SocketChannel(b_sock)
    fd = b_sock.fileno()
    waiting = asyncio.ensure_future(b.readable())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await a.send([b"ping"])
    await asyncio.wait_for(waiting, 5)
    assert await b.recv_exact(4) == b"ping"
    again = asyncio.ensure_future(b.readable())
    await asyncio.sleep(0.05)
    b._on_readable()  # a stale callback: nothing to read, so the waiter sleeps on
    await asyncio.sleep(0.05)
    assert not again.done()
    await a.send([b"x"])
    await asyncio.wait_for(again, 5)
    b.close()
    assert not loop.remove_reader(fd), "close() removes the channel's reader"
    a.close()
