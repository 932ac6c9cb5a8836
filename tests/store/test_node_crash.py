"""kill -9 during a put storm: every block acknowledged as durable is served after restart,
byte for byte, and nothing torn or corrupt is ever served."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from storeutil import checked, make_blocks, make_cfg

from kvstore.node.store import NodeStore
from kvstore.results import Expect, Status

CHILD = pathlib.Path(__file__).with_name("put_storm_child.py")


@pytest.mark.heavy
@pytest.mark.parametrize("kill_after", [5, 40, 120])
async def test_kill_9_mid_storm_keeps_every_durable_ack(tmp_path, kill_after):
    n = 400
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    acked: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while len(acked) < kill_after and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.strip() != "DONE":
                acked.append(line.strip())
        os.kill(proc.pid, signal.SIGKILL)  # mid-storm: more puts are in flight
    finally:
        proc.wait(10)
    assert len(acked) >= kill_after, proc.stderr.read()
    assert len(acked) < n, "the storm finished before the kill; nothing was in flight"

    async with checked(
        await NodeStore.open(
            make_cfg(tmp_path, disk__sync=True, dram__capacity="4MiB", disk__capacity="256MiB")
        )
    ) as node:
        blocks = {h.key.hex: (h, p) for h, p in make_blocks(n, nbytes=128 * 1024, seed=42)}
        # every acknowledged block is there and intact
        for hexkey in acked:
            h, p = blocks[hexkey]
            buf = bytearray(len(p))
            [r] = await node.reader.read([h.key], [buf], [Expect(h.parent, h.token_bytes)])
            assert r.status is Status.HIT, hexkey
            assert bytes(buf) == p
        # whatever else made it to disk is whole: no block fails its checksum
        report = await node.inspector.verify()
        assert report["corrupt"] == []
        assert report["checked"] >= len(acked)
