"""Running Triton kernels in tests: on CUDA when there is a device, else on CPU under Triton's
interpreter. The interpreter must be on when triton is first imported (its library functions
are decorated then), so importing this module turns it on for the process on a machine without
CUDA; a test module imports it before anything imports triton."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernels_run() -> str | None:
    """None when Triton kernels can run here, else the reason they cannot."""
    if not HAS_TRITON:
        return "triton is not installed"
    if HAS_CUDA:
        return None
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") != "1" or type(tl.zeros).__name__ != "InterpretedFunction":
        return (
            "no CUDA, and triton was imported before TRITON_INTERPRET=1 was set (run with TRITON_INTERPRET=1)"
        )
    return None


def skip_unless_kernels_run():
    reason = kernels_run()
    return pytest.mark.skipif(reason is not None, reason=reason or "")
