"""The connector reaches the store through one facade: its modules import only ``kvstore.keys``
and ``kvstore.client`` (``kvstore.client.open`` and the names it re-exports), and importing
the facade loads nothing heavy (no node store, no node or cluster client, no RDMA, no numpy,
torch, LMDB or aiohttp) until a URL asks for it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {"kvstore.keys", "kvstore.client"}
# Imports left out of the check, each until a named change lands (none now).
WAIVED: dict[str, set[str]] = {}


def kvstore_imports(path: Path) -> set[str]:
    """The ``kvstore`` modules ``path`` imports anywhere in its body (``from m import x``
    counts as ``m``: the names come from the module, not from a submodule ``m.x``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {n for n in names if n == "kvstore" or n.startswith("kvstore.")}
    return out


def test_the_check_sees_every_form_of_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import kvstore.node.store\nfrom kvstore.client import open\n"
        "def f():\n    from kvstore.results import Status\n"
    )
    assert kvstore_imports(src) == {"kvstore.node.store", "kvstore.client", "kvstore.results"}


def test_connector_imports_only_the_facade_and_keys():
    files = sorted((ROOT / "connector").glob("*.py"))
    assert files, "no connector modules found"
    bad = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        got = kvstore_imports(path)
        waived = WAIVED.get(rel, set())
        assert waived <= got, f"{rel}: waived imports {waived - got} are gone: delete them from WAIVED"
        extra = got - ALLOWED - waived
        if extra:
            bad[rel] = sorted(extra)
    assert not bad, f"connector modules reaching past kvstore.client: {bad}"


_HEAVY = (
    "kvstore.node",
    "kvstore.client.node",
    "kvstore.client.cluster",
    "kvstore.client.conn",
    "kvstore.client.local",
    "kvstore.client.rdma",
    "kvstore.daemon",
    "rdma",
    "numpy",
    "torch",
    "lmdb",
    "aiohttp",
)

_PROBE = """
import sys
import kvstore.client
import kvstore.client.facade
from kvstore.client import open, StoreClient, PutReport, Status, GetResult, Expect, make_header
stage = sys.argv[1]
if stage == "local":
    open("local:///nonexistent/never-opened")
elif stage == "kvstore":
    open("kvstore://127.0.0.1:1?transport=tcp")
heavy = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in {heavy!r}))
print(",".join(heavy))
"""


def _loaded_after(stage: str) -> set[str]:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=_HEAVY), stage],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return {m for m in r.stdout.strip().split(",") if m}


def test_importing_the_facade_loads_nothing_heavy():
    assert _loaded_after("import") == set()


def test_a_url_loads_only_what_it_needs():
    # local:// builds its client; the node store (tiers, LMDB) loads at the first call
    local = _loaded_after("local")
    assert "kvstore.client.local" in local
    assert not {m for m in local if m.startswith("kvstore.node") or m in ("torch", "lmdb", "aiohttp")}
    # kvstore:// builds the cluster client; it opens no connection and no node store
    remote = _loaded_after("kvstore")
    assert "kvstore.client.cluster" in remote
    assert not {m for m in remote if m.startswith("kvstore.node") or m in ("torch", "lmdb")}
