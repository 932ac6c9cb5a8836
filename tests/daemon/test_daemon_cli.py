"""`kvstore serve` flags and start-up errors."""

from __future__ import annotations

import subprocess
import sys


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_bad_config_key_names_the_key(tmp_path):
    r = _serve("--set", "dram.capacty=1GiB", "--set", f"disk.path={tmp_path}")
    assert r.returncode == 2
    assert "dram.capacty" in r.stderr


def test_rdma_without_a_device_is_an_error_at_start(tmp_path):
    r = _serve("--set", "server.transport=rdma", "--set", "disk.enabled=false")
    assert r.returncode == 2
    assert "rdma" in r.stderr.lower() and "device" in r.stderr


def test_missing_token_file_is_an_error_at_start(tmp_path):
    r = _serve("--set", f"auth.token_file={tmp_path / 'nope'}", "--set", "disk.enabled=false")
    assert r.returncode == 2
    assert "auth.token_file" in r.stderr
