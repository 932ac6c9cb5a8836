"""Fixtures for daemon tests: real ``kvstore serve`` subprocesses on ephemeral loopback ports.

``start_daemon(**overrides)`` writes a config into a tmp dir, starts the daemon, waits for its
port file and returns a :class:`Daemon` handle; every daemon is stopped at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import make_header
from kvstore.keys import Namespace

REPO = Path(__file__).resolve().parents[2]


class Daemon:
    def __init__(self, proc: subprocess.Popen, ports: dict, workdir: Path, log: Path) -> None:
        self.proc = proc
        self.ports = ports
        self.workdir = workdir
        self.log = log

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.ports['data_port']}"

    @property
    def data_port(self) -> int:
        return self.ports["data_port"]

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin_port']}"

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def _toml(value) -> str:
    return (
        json.dumps(value)
        if isinstance(value, str)
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


@pytest.fixture
def start_daemon(tmp_path):
    started: list[Daemon] = []
    counter = [0]

    def start(use_disk: bool = True, workdir: Path | None = None, **sections) -> Daemon:
        counter[0] += 1
        wd = workdir or tmp_path / f"node{counter[0]}"
        wd.mkdir(parents=True, exist_ok=True)
        cfg = {
            "dram": {"capacity": "64MiB", "slab_size": "4MiB"},
            "disk": {"enabled": True, "path": str(wd / "disk"), "capacity": "256MiB", "sync": False},
            "server": {"port_file": str(wd / "ports.json")},
        }
        for sec, values in sections.items():
            cfg.setdefault(sec, {}).update(values)
        if not use_disk:
            cfg["disk"] = {"enabled": False}
        text = "".join(
            f"[{sec}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in vals.items())
            for sec, vals in cfg.items()
        )
        (wd / "node.toml").write_text(text)
        port_file = wd / "ports.json"
        port_file.unlink(missing_ok=True)
        log = wd / f"daemon{counter[0]}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.cli", "serve", "--config", str(wd / "node.toml")],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"daemon did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        d = Daemon(proc, json.loads(port_file.read_text()), wd, log)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(10)


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", "uint8", 4)


def make_blocks(ns: Namespace, n: int, size: int, seed: int = 0, start_token: int = 0):
    """A chain of ``n`` blocks of random payload (``size`` bytes each): [(header, payload)]."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 50000, n * ns.block_tokens)]
    tokens[0] = start_token + seed
    keys = ns.block_keys(tokens)
    out, parent = [], ns.id
    for i, k in enumerate(keys):
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        toks = tokens[i * ns.block_tokens : (i + 1) * ns.block_tokens]
        out.append(
            (
                make_header(
                    key=k,
                    parent=parent,
                    namespace=ns.id,
                    tokens=toks,
                    dtype="uint8",
                    shape=[size],
                    payload=payload,
                ),
                payload,
            )
        )
        parent = k
    return out


@pytest.fixture
def blocks_of():
    return make_blocks
