"""Arenas: the one big buffer behind a memory tier.

``HostArena`` is one host allocation (page-locked through torch/CUDA when asked and possible,
else an anonymous mmap), exposed as a memoryview so the RDMA layer can register it once.
``CudaArena`` is one uint8 tensor on a GPU. Both offer the same byte copies; callers keep
offsets in range (the slab allocator hands them out). Not thread-safe.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys

from kvstore.errors import TierError

log = logging.getLogger("tierkv.arena")


class HostArena:
    """``size`` bytes of host memory. ``pin``: "auto" pins when torch sees CUDA, "true" requires
    it (TierError otherwise), "false" never pins. ``prefault`` maps every page at start (pinned
    memory always is)."""

    def __init__(self, size: int, pin: str = "auto", prefault: bool = False) -> None:
        self.size = size
        self.pinned = False
        self._tensor = None
        self._mmap = None
        if pin in ("auto", "true"):
            self._tensor = _pinned_tensor(size)
            if self._tensor is None and pin == "true":
                raise TierError("dram.pin = true but torch with CUDA is not available to page-lock memory")
        if self._tensor is not None:
            self.pinned = True
            self.view = memoryview(self._tensor.numpy()).cast("B")
        else:
            # A fresh page costs a fault on first write (~0.2 GB/s against ~5 GB/s once mapped);
            # prefault takes that cost once, at start: chunk by chunk, not with MAP_POPULATE,
            # whose single call holds the process's memory-map lock for seconds and so stalls
            # every other thread (the daemon's loop answering /readyz) until it ends.
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.view = memoryview(self._mmap)
            if prefault:
                _touch(self.view)

    def write(self, offset: int, src) -> None:
        mv = memoryview(src).cast("B")
        self.view[offset : offset + mv.nbytes] = mv

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.view[offset : offset + nbytes])

    def slice(self, offset: int, nbytes: int) -> memoryview:
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        """Drop the arena. Slices still held elsewhere keep the memory alive until collected."""
        try:
            self.view.release()
            if self._mmap is not None:
                self._mmap.close()
        except BufferError:
            pass  # a lease or reservation still exports a slice; GC frees the mapping later
        self._mmap = None
        self._tensor = None


def _touch(view: memoryview, chunk: int = 32 << 20) -> None:
    """Fault in every page of a fresh anonymous mapping by writing zeros, a chunk at a time."""
    zeros = bytes(min(chunk, view.nbytes))
    for off in range(0, view.nbytes, chunk):
        n = min(chunk, view.nbytes - off)
        view[off : off + n] = zeros[:n] if n < len(zeros) else zeros


class CudaArena:
    """``size`` bytes on a CUDA device, as one uint8 tensor. TierError when CUDA is absent."""

    pinned = False

    def __init__(self, size: int, device: str) -> None:
        try:
            import torch
        except ImportError as exc:
            raise TierError(
                "hbm tier configured but torch is not installed (a CUDA build of torch >= 2.4)"
            ) from exc
        if not torch.cuda.is_available():
            raise TierError(f"hbm tier configured (device {device!r}) but CUDA is not available")
        self._torch = torch
        self.size = size
        self.tensor = torch.empty(size, dtype=torch.uint8, device=device)
        self.view = None  # device memory: no host view

    def write(self, offset: int, src) -> None:
        t = self._torch.frombuffer(memoryview(src).cast("B"), dtype=self._torch.uint8)
        self.tensor[offset : offset + t.numel()].copy_(t)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.tensor[offset : offset + nbytes].cpu().numpy().tobytes()

    def slice(self, offset: int, nbytes: int):
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        self.tensor = None


def _pinned_tensor(size: int):
    # Importing torch costs seconds; a host with no NVIDIA device node cannot pin through CUDA.
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return None
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:  # out of lockable memory: fall back, say so once
        log.warning("event=pin_failed size=%d error=%r", size, exc)
        return None
