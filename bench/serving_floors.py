"""Hardware floors for bench/gpu_engine.py and bench/ttft.py, measured in the same run as the
cases they bound.

- ``matmul_peak_tflops``: a large square matmul in the model's dtype (best of several).
- ``device_copy_bytes_per_s``: read bandwidth of the device's memory (a large copy reads and
  writes each byte once: 2 x bytes / time).
- ``h2d_bytes_per_s``: page-locked host -> device copy bandwidth (on a GPU, part of a hit's floor).
"""

from __future__ import annotations

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
