"""Floors for bench/gpu_serving.py, measured in the same run as the cases they bound, and the
daemon the remote cases use.

- ``matmul_peak_tflops``: a large square matmul in the model's dtype (best of several).
- ``device_copy_bytes_per_s``: read bandwidth of the device's memory (a large copy reads and
  writes each byte once: 2 x bytes / time).
- ``loopback_bytes_per_s``: bytes/s over ``streams`` parallel TCP connections on 127.0.0.1
  (what the connector's parallel GETs could move at best).
- ``DaemonProcess``: ``kvstore serve`` on ephemeral loopback ports, ready (``/readyz``) before
  it is used, stopped on exit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

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


class DaemonProcess:
    """``kvstore serve`` with a DRAM tier of ``dram_bytes`` (no disk) under ``root``."""

    def __init__(self, root: str, dram_bytes: int, ready_s: float = 120.0) -> None:
        self.root, self.dram_bytes, self.ready_s = root, dram_bytes, ready_s
        self.proc: subprocess.Popen | None = None
        self.addr = ""

    def __enter__(self) -> DaemonProcess:
        ports = os.path.join(self.root, "ports.json")
        cfg = os.path.join(self.root, "node.toml")
        with open(cfg, "w") as f:
            f.write(
                f'[dram]\ncapacity = "{self.dram_bytes}"\n[disk]\nenabled = false\n'
                f'[server]\nport_file = "{ports}"\n'
            )
        log = open(os.path.join(self.root, "daemon.log"), "w")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--config", cfg], stdout=log, stderr=log
        )
        end = time.monotonic() + self.ready_s
        while not os.path.exists(ports):
            self._alive_until(end)
            time.sleep(0.05)
        with open(ports) as f:
            info = json.load(f)
        self.addr = f"127.0.0.1:{info['data_port']}"
        ready = f"http://127.0.0.1:{info['admin_port']}/readyz"
        while True:  # a daemon pins and faults its DRAM tier in before it serves
            try:
                with urllib.request.urlopen(ready, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            self._alive_until(end)
            time.sleep(0.1)

    def _alive_until(self, end: float) -> None:
        if self.proc.poll() is not None:
            raise SystemExit(f"daemon exited with {self.proc.returncode}; see {self.root}/daemon.log")
        if time.monotonic() > end:
            self.proc.kill()
            raise SystemExit(f"daemon not ready after {self.ready_s} s; see {self.root}/daemon.log")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
