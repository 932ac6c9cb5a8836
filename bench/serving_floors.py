"""Floors for bench/gpu_serving.py (and bench/gpu_engine.py's matmul peak), measured in the
same run as the cases they bound.

- ``matmul_peak_tflops``: a large square matmul in the model's dtype (best of several).
- ``device_copy_bytes_per_s``: read bandwidth of the device's memory (a large copy reads and
  writes each byte once: 2 x bytes / time).
- ``loopback_bytes_per_s``: bytes/s over ``streams`` parallel TCP connections on 127.0.0.1
  (what the connector's parallel GETs could move at best).
- ``h2d_bytes_per_s``: page-locked host -> device copy bandwidth (a DRAM hit's floor).
"""

from __future__ import annotations

import socket
import threading
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak_tflops(device: str, dtype: torch.dtype, reps: int = 10) -> float:
    n = 8192 if device.startswith("cuda") else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best / 1e12


def device_copy_bytes_per_s(device: str, nbytes: int | None = None) -> float:
    nbytes = nbytes or ((2 << 30) if device.startswith("cuda") else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def loopback_bytes_per_s(streams: int, nbytes: int, chunk: int = 4 << 20) -> float:
    """Send ``nbytes`` in total over ``streams`` loopback connections at once (sender and
    receiver threads; receives into a reused buffer, as the client does); best of 3."""
    per = max(chunk, nbytes // streams)
    return max(_loopback_round(streams, per, chunk) for _ in range(3))


def _loopback_round(streams: int, per: int, chunk: int) -> float:
    payload = memoryview(bytearray(chunk))
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(streams)
    port = srv.getsockname()[1]
    done = threading.Barrier(streams * 2 + 1)

    def recv(conn: socket.socket) -> None:
        buf = memoryview(bytearray(chunk))
        left = per
        while left:
            got = conn.recv_into(buf, min(chunk, left))
            if not got:
                break
            left -= got
        conn.close()
        done.wait()

    def send() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        left = per
        while left:
            k = min(chunk, left)
            s.sendall(payload[:k])
            left -= k
        done.wait()
        s.close()

    senders = [threading.Thread(target=send, daemon=True) for _ in range(streams)]
    t0 = time.perf_counter()
    for t in senders:
        t.start()
    for _ in range(streams):
        conn, _ = srv.accept()
        threading.Thread(target=recv, args=(conn,), daemon=True).start()
    done.wait(timeout=600)
    secs = time.perf_counter() - t0
    srv.close()
    return per * streams / secs


def h2d_bytes_per_s(device: str, nbytes: int = 1 << 30) -> float:
    """Page-locked host -> device copy bandwidth (best of 5), or 0.0 on CPU."""
    if not device.startswith("cuda"):
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
