"""Data-port field names live in kvstore/protocol/ only (issue 14), and rdma/ knows no store op.

Both ends build and read frames with the typed messages of :mod:`kvstore.protocol`, so a
field's name is written once. This reads the sources: a string literal used as a map key (a
dict display's key, a subscript, the first argument of ``get``/``pop``/``setdefault``) that
is a wire field name, in the client's connection modules or the daemon's, is a field name
outside kvstore/protocol/. The wire field names are taken from that package itself (every literal it
uses as a key), plus framing's ``plen``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the data port's modules: no wire field name at all
DATA_PORT = [
    "kvstore/client/conn.py",
    "kvstore/client/leased.py",
    *(
        f"kvstore/daemon/{m}.py"
        for m in ("dataport", "block_ops", "descriptor_ops", "session", "transfer", "slab_rdma")
    ),
]
# names only the data port uses; the rest of kvstore/daemon/ (the admin port's JSON has its own
# "keys", "tiers", "ok") must not use them either
DATA_PORT_ONLY = {
    "rid",
    "hdrs",
    "hend",
    "descs",
    "handles",
    "caps",
    "exp",
    "plen",
    "res",
    "ttl",
    "max_frame",
    "salt",
}
STORE_OPS = {"HELLO", "EXISTS", "GET", "PUT", "DELETE", "LEASE", "RELEASE", "READ", "RESERVE", "WRITE"}


def key_literals(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every string literal used as a map key in ``source``."""
    out = []

    def add(node) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            for k in node.keys:
                add(k)
        elif isinstance(node, ast.Subscript):
            add(node.slice)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
        ):
            add(node.args[0])
    return out


def string_literals(source: str) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def wire_fields() -> set[str]:
    return {
        text
        for f in sorted((ROOT / "kvstore/protocol").glob("*.py"))
        for _, text in key_literals(f.read_text())
    } | {"plen"}


def test_the_scan_finds_field_names_used_as_keys():
    src = 'h = {"rid": 1}\nh["keys"]\nh.get("hdrs", 0)\nx = "res"\n'
    assert [t for _, t in key_literals(src)] == ["rid", "keys", "hdrs"]  # a plain value is no key
    assert {"rid", "keys", "hdrs", "res", "descs", "handles", "ok", "code", "err"} <= wire_fields()


def test_no_wire_field_name_outside_protocol():
    fields = wire_fields()
    found = []
    for rel in DATA_PORT:
        found += [(rel, line, t) for line, t in key_literals((ROOT / rel).read_text()) if t in fields]
    for path in sorted((ROOT / "kvstore/daemon").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in DATA_PORT:
            found += [(rel, line, t) for line, t in key_literals(path.read_text()) if t in DATA_PORT_ONLY]
    assert not found, f"wire field names outside kvstore/protocol/: {found}"


def test_rdma_knows_no_store_op():
    """rdma/ moves bytes and frames; the store's ops and their fields are kvstore's."""
    found = []
    for path in sorted((ROOT / "rdma").glob("*.py")):
        src = path.read_text()
        ops = string_literals(src) & STORE_OPS
        keys = {t for _, t in key_literals(src)} & (wire_fields() - {"plen"})
        if ops or keys:
            found.append((path.name, sorted(ops | keys)))
    assert not found, f"store ops or fields in rdma/: {found}"
