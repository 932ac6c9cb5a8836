"""A storage node needs none of the engine's packages: ``pip install tierkv`` lists none of them,
and a real ``kvstore serve`` daemon, a client round trip through ``kvstore.client`` and the
inspection CLI (``stats``, ``ls``, ``show``, ``verify``) run in processes where importing torch,
fastapi, uvicorn, tokenizers, jinja2 or transformers fails. ``kvstore lookup`` with a prompt
says in one line which extra it needs and exits 2.

The blocker is a ``sys.meta_path`` finder installed by a ``sitecustomize`` on a temporary
``PYTHONPATH``, so every Python process started with that environment (the daemon too) has it
from its first line; each process records that it installed it, and the check that it works
is a test here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from daemonutil import REPO, launch_daemon

ENGINE_PACKAGES = ("torch", "fastapi", "uvicorn", "tokenizers", "jinja2", "transformers")
# what else the engine's extras bring, which the store's base install must not list either
ENGINE_ONLY = {*ENGINE_PACKAGES, "safetensors", "gguf", "accelerate", "flash-attn", "triton"}

SITECUSTOMIZE = """\
import importlib.abc
import os
import sys

BLOCKED = {blocked!r}
LOG = {log!r}


class _EngineBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            with open(LOG, "a") as f:
                f.write(f"blocked {{os.getpid()}} {{name}}\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _EngineBlocker())
with open(LOG, "a") as f:
    f.write(f"installed {{os.getpid()}} {{' '.join(sys.argv)}}\\n")
"""

ROUND_TRIP = """\
import asyncio
import os
import sys

import kvstore.client
from kvstore.block import make_header
from kvstore.client import Status, get_into
from kvstore.keys import Namespace

NS = Namespace("store-only-model", "uint8", 4)


async def main(addr):
    tokens = list(range(100, 100 + 3 * NS.block_tokens))
    keys = NS.block_keys(tokens)
    blocks, parent = [], NS.id
    for i, key in enumerate(keys):
        payload = os.urandom(4096 + i)
        toks = tokens[i * NS.block_tokens : (i + 1) * NS.block_tokens]
        blocks.append((make_header(key=key, parent=parent, namespace=NS.id, tokens=toks,
                                   dtype="uint8", shape=[len(payload)], payload=payload), payload))
        parent = key
    c = kvstore.client.open(f"kvstore://{addr}?replicas=1&transport=tcp", namespaces=(NS,))
    try:
        report = await c.put(blocks, 10.0)
        assert len(report) == len(blocks) and report.stored == len(blocks), list(report)
        tiers = (await c.lookup(keys, 10.0)).names()
        assert len(tiers) == len(keys) and all(t is not None for t in tiers), tiers
        bufs = [bytearray(len(p)) for _, p in blocks]
        got = await get_into(c, keys, bufs, None, 10.0)
        assert [g.status for g in got] == [Status.HIT] * len(keys), got
        assert [bytes(b) for b in bufs] == [p for _, p in blocks], "payload bytes differ"
    finally:
        await c.close()
    print(" ".join(k.hex for k in keys))


asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture
def blocked_env(tmp_path) -> tuple[dict[str, str], Path]:
    """An environment whose Python processes cannot import the engine's packages, and the log
    where each records that it installed the blocker and what it refused."""
    site = tmp_path / "blocker"
    site.mkdir()
    log = tmp_path / "blocked.log"
    log.touch()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=set(ENGINE_PACKAGES), log=str(log)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env, log


def _run(env, *argv, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    if check:
        what = " ".join(a if len(a) < 60 else a[:40] + "..." for a in argv[1:])
        assert p.returncode == 0, f"{what} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def _installed_pids(log: Path) -> dict[int, str]:
    lines = [line.split(" ", 2) for line in log.read_text().splitlines() if line.startswith("installed ")]
    return {int(pid): argv for _, pid, argv in lines}


def test_the_blocker_refuses_every_engine_package(blocked_env):
    env, log = blocked_env
    for name in ENGINE_PACKAGES:
        p = _run(env, sys.executable, "-c", f"import {name}", check=False)
        assert p.returncode == 1 and "ModuleNotFoundError" in p.stderr, (name, p.stderr)
    refused = [line.split()[2] for line in log.read_text().splitlines() if line.startswith("blocked ")]
    assert sorted(refused) == sorted(ENGINE_PACKAGES)


def test_a_storage_node_serves_and_answers_without_the_engine(blocked_env, tmp_path):
    env, log = blocked_env
    d = launch_daemon(tmp_path / "node", env=env)
    try:
        keys = _run(env, sys.executable, "-c", ROUND_TRIP, d.addr).stdout.split()
        assert len(keys) == 3
        kv = [sys.executable, "-m", "kvstore.cli"]
        stats = json.loads(_run(env, *kv, "stats", "--node", d.admin, "--json").stdout)
        (node,) = stats["nodes"]
        assert node["tiers"]["dram"]["blocks"] == 3, stats  # write-through: on disk as well
        listed = json.loads(_run(env, *kv, "ls", "--node", d.admin, "--json").stdout)
        assert listed["count"] == 3 and sorted(b["key"] for b in listed["blocks"]) == sorted(keys)
        shown = json.loads(_run(env, *kv, "show", keys[0], "--node", d.admin, "--json").stdout)
        assert len(shown["replicas"]) == 1, shown
        _run(env, *kv, "verify", "--node", d.admin)
        # a prompt needs the engine's tokenizer: one line naming the extra, status 2
        p = _run(env, *kv, "lookup", "--model", str(tmp_path), "some prompt", "--node", d.admin, check=False)
        assert p.returncode == 2, (p.stdout, p.stderr)
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and "pip install 'tierkv[engine]'" in err[0], p.stderr
        p = _run(env, *kv, "show", keys[0], "--tokenizer", str(tmp_path), "--node", d.admin, check=False)
        assert p.returncode == 2 and "--tokenizer uses the engine's tokenizer" in p.stderr, p.stderr
        assert "pip install 'tierkv[engine]'" in p.stderr
        # and the engine's own command, installed with the store, says the same
        p = _run(
            env, sys.executable, "-m", "engine.cli", "generate", "--model", str(tmp_path), "hi", check=False
        )
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "is not installed: pip install 'tierkv[engine]'" in p.stderr, p.stderr
        assert d.proc.poll() is None, d.logs()
    finally:
        assert d.stop() == 0, d.logs()
    # every process ran with the blocker: the daemon, the client and the seven commands above
    pids = _installed_pids(log)
    assert d.proc.pid in pids and "serve" in pids[d.proc.pid], pids
    assert len(pids) == 1 + 1 + 7, pids


def test_the_store_install_lists_none_of_the_engine_packages():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for r in reqs:
            name = r.split(";")[0]
            for sep in "<>=!~[ ":
                name = name.split(sep)[0]
            out.add(name.strip().lower())
        return out

    base = names(project["dependencies"])
    assert {"xxhash", "msgpack", "lmdb", "aiohttp"} <= base  # the check reads the real list
    assert not base & ENGINE_ONLY, f"the store's install pulls in {sorted(base & ENGINE_ONLY)}"
    extras = project["optional-dependencies"]
    assert {"torch", "fastapi", "uvicorn", "tokenizers", "jinja2"} <= names(extras["engine"])
    # the extras that need the engine bring it
    for extra in ("gguf", "gpu"):
        assert "tierkv[engine]" in extras[extra], extra
