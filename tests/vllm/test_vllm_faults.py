"""vLLM with tierkv when the store misbehaves: a wrong token serves misses and says why once;
a block corrupted on the daemon's disk is recomputed, with the tokens the recompute gives.

One daemon with auth for the module (its disk the only tier, so a read after a restart comes
from disk): an engine with the right token saves PQ; an engine with a wrong token runs PQ;
then the daemon is stopped, one of PQ's blocks is corrupted in its LMDB file, the daemon
restarted, and an engine with the right token runs PQ again."""

from __future__ import annotations

import random

import lmdb
import pytest
from daemonutil import launch_daemon

from kvstore.block import BlockHeader
from kvstore.keys import tokens_le_bytes
from tests.vllm import vllmutil

pytestmark = pytest.mark.timeout(900)

BS = 32
_RNG = random.Random(7)
PQ = [_RNG.randrange(1000, 40000) for _ in range(5 * BS + 3)]
AUTH_SAID = "tierkv: the store refused this vLLM's token"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    wd = tmp_path_factory.mktemp("vllm-auth-node")
    (wd / "tokens").write_text("right-token tenant-a\n")
    sections = {"auth": {"token_file": str(wd / "tokens")}, "dram": {"capacity": 0}, "disk": {"sync": True}}
    node = launch_daemon(wd, **sections)
    yield {"node": node, "wd": wd, "sections": sections}
    node.stop(10)


@pytest.fixture(scope="module")
def saved(vllm_python, smol_model, store, tmp_path_factory) -> dict:
    """PQ run cold by an engine with the right token (its blocks saved)."""
    wd = tmp_path_factory.mktemp("saver")
    spec = vllmutil.kv(f"kvstore://{store['node'].addr}", wd / "s", token="right-token", tenant="tenant-a")
    res = vllmutil.run(vllm_python, smol_model, [PQ], spec, wd / "s.log", policy="always")
    assert res["stats"]["worker-tp0"]["saved_blocks"] == 5
    return res


def test_a_wrong_token_serves_misses_and_says_why_once(vllm_python, smol_model, store, saved, tmp_path):
    spec = vllmutil.kv(
        f"kvstore://{store['node'].addr}", tmp_path / "w", token="wrong-token", tenant="tenant-a"
    )
    res = vllmutil.run(vllm_python, smol_model, [PQ, PQ[:-1]], spec, tmp_path / "w.log")
    assert res["outputs"][0] == saved["outputs"][0]
    assert res["cached"][0] == 0
    s = res["stats"]["scheduler"]
    assert s["lookup_requests"] == 2 and s["held_tokens"] == 0
    assert s["store.auth_refused"] >= 1
    assert (tmp_path / "w.log").read_text().count(AUTH_SAID) == 1


def test_a_corrupt_block_on_disk_is_recomputed(vllm_python, smol_model, store, saved, tmp_path):
    node = store["node"]
    assert node.stop() == 0
    _flip_a_byte_of_block(store["wd"] / "disk", PQ[2 * BS : 3 * BS])
    store["node"] = node = launch_daemon(store["wd"], **store["sections"])
    spec = vllmutil.kv(f"kvstore://{node.addr}", tmp_path / "r", token="right-token", tenant="tenant-a")
    res = vllmutil.run(vllm_python, smol_model, [PQ], spec, tmp_path / "r.log", policy="always")
    assert res["outputs"] == saved["outputs"]
    w = res["stats"]["worker-tp0"]
    assert w["loaded_tokens"] == 2 * BS  # blocks 0 and 1; block 2 and the rest recomputed
    assert w["load_error_blocks"] == 3
    assert w.get("recompute_fallbacks.corrupt", 0) + w.get("recompute_fallbacks.miss", 0) >= 1, w


def _flip_a_byte_of_block(disk, tokens: list[int]) -> None:
    """Flip one payload byte of the stored block holding ``tokens`` (the daemon stopped)."""
    want = tokens_le_bytes(tokens)
    env = lmdb.open(str(disk), max_dbs=2)
    try:
        hdr, data = env.open_db(b"hdr"), env.open_db(b"data")
        with env.begin(write=True) as txn:
            keys = [k for k, v in txn.cursor(db=hdr) if BlockHeader.decode(v).token_bytes == want]
            assert len(keys) == 1, f"{len(keys)} stored blocks hold these tokens"
            payload = bytearray(txn.get(keys[0], db=data))
            payload[len(payload) // 2] ^= 0xFF
            txn.put(keys[0], bytes(payload), db=data)
    finally:
        env.close()
