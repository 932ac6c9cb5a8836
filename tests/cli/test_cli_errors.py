"""Exit status 2 with a message naming the node and what failed: unreachable node, silent
node, bad or missing token, tenant token, --cluster, bad input; and a good token works."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from ports import free_port


def test_unreachable_node(cli):
    url = f"http://127.0.0.1:{free_port()}"
    for cmd in (["ls"], ["stats"], ["show", "ab" * 16], ["verify"], ["pin", "ab" * 16]):
        r = cli(*cmd, "--node", url)
        assert r.code == 2, cmd
        assert f"node {url}: cannot connect" in r.err, r.err
    r = cli("ls", "--node", url, "--json")
    assert (
        r.code == 2 and r.json()["error"]["node"] == url and "cannot connect" in r.json()["error"]["message"]
    )


def test_one_unreachable_node_among_good_ones_fails_naming_it(cli, start_daemon):
    d = start_daemon(use_disk=False)
    bad = f"http://127.0.0.1:{free_port()}"
    r = cli("ls", "--node", d.admin, "--node", bad)
    assert r.code == 2 and bad in r.err and d.admin not in r.err


def test_silent_node_times_out():
    with socket.socket() as srv:  # accepts connections (backlog) and never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        out = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "stats", "--node", url, "--timeout", "0.5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert f"node {url}: GET /v1/stats: no answer within 0.5 s" in out.stderr


@pytest.fixture
def authed(start_daemon, tmp_path):
    f = tmp_path / "tokens"
    f.write_text("tok-operator1 *\ntok-acme-0001 acme\n")
    return start_daemon(use_disk=False, auth={"token_file": str(f)})


def test_tokens(cli, authed, tmp_path):
    n = ["--node", authed.admin]
    r = cli("ls", *n)
    assert r.code == 2 and f"node {authed.admin}: GET /v1/blocks: refused (401" in r.err
    assert "--token-file" in r.err
    wrong = tmp_path / "wrong"
    wrong.write_text("tok-nobody-000\n")
    r = cli("stats", *n, "--token-file", wrong)
    assert r.code == 2 and "refused (401" in r.err
    tenant = tmp_path / "tenant"
    tenant.write_text("# a tenant token\ntok-acme-0001\n")
    r = cli("ls", *n, "--token-file", tenant)
    assert r.code == 2 and "refused (403" in r.err and "tenant tokens cannot use the admin API" in r.err
    good = tmp_path / "op"
    good.write_text("tok-operator1\n")
    r = cli("ls", *n, "--token-file", good, "--json")
    assert r.code == 0 and r.json()["count"] == 0
    assert cli("verify", *n, "--token-file", good).code == 0
    r = cli("ls", *n, "--token-file", tmp_path / "missing")
    assert r.code == 2 and "--token-file" in r.err and "cannot read it" in r.err


def test_usage_errors(cli):
    r = cli("ls")
    assert r.code == 2 and "no node given: pass --node URL" in r.err
    r = cli("ls", "--cluster", "etcd://127.0.0.1:1/prod", "--timeout", "1")  # nothing listens on port 1
    assert r.code == 2 and "--cluster etcd://127.0.0.1:1/prod" in r.err
    r = cli("stats", "--cluster", "etcd://127.0.0.1:1/prod", "--json", "--timeout", "1")
    assert r.code == 2 and "etcd" in r.json()["error"]["message"]
    assert "--cluster" in cli("ls", "--cluster", "etcd://nohost").err
    assert "--node 'ftp://x'" in cli("ls", "--node", "ftp://x").err
    assert cli("ls", "--node", "127.0.0.1:1", "--timeout", "0").code == 2
    assert cli("ls", "--node", "127.0.0.1:1", "--limit", "0").code == 2
    assert cli("ls", "--node", "127.0.0.1:1", "--tier", "tape").code == 2  # argparse


def test_every_subcommand_has_complete_help(cli):
    for cmd in ("ls", "show", "lookup", "stats", "verify", "evict", "pin", "unpin"):
        r = cli(cmd, "--help")
        assert r.code == 0, cmd
        for word in (
            "--node",
            "--cluster",
            "--token-file",
            "--json",
            "--timeout",
            "--json output:",
            "exit status",
        ):
            assert word in r.out, (cmd, word)
    top = cli("--help")
    for cmd in ("serve", "ls", "show", "lookup", "stats", "verify", "evict", "pin", "unpin"):
        assert cmd in top.out
