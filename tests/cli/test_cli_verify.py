"""``kvstore verify [--repair]`` and ``show``'s checksum check on a block corrupted on disk
(daemon stopped, one payload byte flipped in LMDB's data.mdb, restarted on the same workdir)."""

from __future__ import annotations

from storeutil import flip_byte_in_file, make_blocks

from kvstore.keys import Namespace

NS = Namespace("cli-verify-model", "float16", 4)


def test_verify_clean_node_pages_through_all_blocks(cli, start_daemon, put_blocks):
    d = start_daemon()
    put_blocks(d.addr, make_blocks(7, 2048, ns=NS), NS)
    j = cli("verify", "--node", d.admin, "--json", "--batch", "3").json()
    assert j == {
        "repair": False,
        "checked": 14,  # every block in dram and on disk
        "corrupt": 0,
        "dropped": 0,
        "nodes": [{"node": d.admin, "checked": 14, "dropped": 0, "corrupt": []}],
    }
    r = cli("verify", "--node", d.admin)
    assert r.code == 0 and "checked 14 copies on 1 node(s): 0 corrupt, 0 dropped" in r.out
    assert cli("verify", "--node", d.admin, "--batch", "0").code == 2


def test_verify_repair_drops_a_block_corrupted_on_disk(cli, start_daemon, put_blocks):
    d = start_daemon()
    blocks = make_blocks(4, 8192, ns=NS, seed=5)
    put_blocks(d.addr, blocks, NS)
    assert d.stop() == 0
    bad_h, bad_payload = blocks[1]
    flip_byte_in_file(str(d.workdir / "disk" / "data.mdb"), bad_payload[:4096])
    d = start_daemon(workdir=d.workdir)  # restart: blocks only on disk now
    bad = bad_h.key.hex
    n = ["--node", d.admin]

    s = cli("show", bad, *n, "--json").json()
    assert s["replicas"][0]["checksum_ok"] is False and s["replicas"][0]["corrupt_tiers"] == ["disk"]
    assert "CORRUPT disk" in cli("show", bad, *n).out
    good = cli("show", blocks[0][0].key.hex, *n, "--json").json()
    assert good["replicas"][0]["checksum_ok"] is True

    r = cli("verify", *n)
    assert r.code == 1 and bad in r.out and "corrupt" in r.out and "1 corrupt, 0 dropped" in r.out
    j = cli("verify", *n, "--json").json()
    assert j["corrupt"] == 1 and j["nodes"][0]["corrupt"] == [{"key": bad, "tier": "disk"}]

    r = cli("verify", *n, "--repair", "--json")
    assert r.code == 0 and r.json()["dropped"] == 1 and r.json()["checked"] == 4
    assert cli("show", bad, *n).code == 1
    after = cli("verify", *n, "--json").json()
    assert after["corrupt"] == 0 and after["checked"] == 3
    st = cli("stats", *n, "--json").json()["nodes"][0]
    assert st["checksum_failures"] >= 1


def test_verify_shows_a_progress_bar_on_a_terminal(cli, start_daemon, put_blocks, monkeypatch):
    from rich.console import Console

    d = start_daemon(use_disk=False)
    put_blocks(d.addr, make_blocks(120, 256, ns=NS, seed=8), NS)
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    r = cli("verify", "--node", d.admin, "--batch", "16")
    assert r.code == 0 and "checked 120 copies" in r.out
    assert f"verify {d.admin}" in r.err and "120/120" in r.err  # the bar reached the total
