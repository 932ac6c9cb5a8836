"""``kvstore ls`` and ``kvstore evict --namespace`` follow a node's listing cursor to its real
end (issue 33, finding 2): a page filtered by namespace looks at a bounded number of keys, so
on a node where the namespace is rare it comes back short or empty with a cursor, and only a
page without one is the end."""

from __future__ import annotations

from storeutil import make_blocks

from kvstore.keys import Namespace
from kvstore.node.inspection import SCAN_MIN

RARE = Namespace("cli-rare-model", "float16", 4)
COMMON = Namespace("cli-common-model", "float16", 4)


def test_ls_and_evict_of_a_rare_namespace_reach_the_end(cli, start_daemon, put_blocks):
    d = start_daemon()
    common = make_blocks(2 * SCAN_MIN + 500, 64, ns=COMMON, seed=5)
    for off in range(0, len(common), 2000):
        put_blocks(d.addr, common[off : off + 2000], COMMON)
    rare = make_blocks(6, 64, ns=RARE, seed=6)
    put_blocks(d.addr, rare, RARE)
    want = sorted(h.key.hex for h, _ in rare)

    j = cli("ls", "--node", d.admin, "--json", "--namespace", RARE.id.hex, "--limit", "1000").json()
    assert [b["key"] for b in j["blocks"]] == want and j["truncated"] is False
    j = cli("ls", "--node", d.admin, "--json", "--limit", "100000").json()
    assert j["count"] == len(common) + len(rare) and j["truncated"] is False

    r = cli("evict", "--namespace", RARE.id.hex, "--node", d.admin, "--json")
    assert r.code == 0, r.err
    assert r.json()["deleted"] == len(rare)
    j = cli("ls", "--node", d.admin, "--json", "--namespace", RARE.id.hex).json()
    assert j["count"] == 0
    r = cli("evict", "--namespace", COMMON.id.hex, "--node", d.admin, "--json")
    assert r.json()["deleted"] == len(common)
