"""The client's channel sends large payloads the daemon's way: a blocking socket with
``SO_SNDTIMEO`` (its connection's worker slice), the kernel waiting for room inside
``sendmsg`` (rdma/bursts.py ``send_slices``); loop calls never block on it."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rdma.channel import SocketChannel

MiB = 1 << 20


async def test_a_client_channel_sends_in_slices_and_its_bytes_arrive_whole_to_a_slow_reader():
    srv = socket.create_server(("127.0.0.1", 0))
    pool = ThreadPoolExecutor(1)
    ch = await SocketChannel.connect("127.0.0.1", srv.getsockname()[1], pool, 0.2)
    peer, _ = srv.accept()
    srv.close()
    sec, usec = struct.unpack("ll", ch.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16))
    assert (sec, usec) == (0, 200_000) and ch.sock.getblocking()
    payload = np.random.default_rng(5).integers(0, 256, 24 * MiB, dtype=np.uint8)
    got = bytearray()

    def slow_reader() -> None:
        while len(got) < payload.nbytes:
            chunk = peer.recv(256 << 10)
            if not chunk:
                return
            got.extend(chunk)
            threading.Event().wait(0.002)

    t = threading.Thread(target=slow_reader)
    t.start()
    ticks = 0

    async def ticker() -> None:  # the loop stays free while the worker waits in the kernel
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick = asyncio.create_task(ticker())
    await ch.send([payload])
    tick.cancel()
    await asyncio.to_thread(t.join)
    assert bytes(got) == payload.tobytes()
    assert ch.bytes_out == payload.nbytes
    assert ticks > 0
    ch.close()
    peer.close()
    pool.shutdown()
