"""Weighted rendezvous placement: determinism, distinct nodes and zones, proportional shares,
and minimal movement on joins and leaves (hypothesis for the invariants, fixed seeds for the
statistics)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.address import parse_host_port
from kvstore.client.etcd import parse_etcd_url
from kvstore.client.membership import Member, MembershipError, StaticMembership
from kvstore.client.node import NodeClient
from kvstore.client.placement import Node, owners, rank, rank_many, rank_positions
from kvstore.errors import AddressError
from kvstore.keys import KeyBatch

keys_st = st.binary(min_size=16, max_size=16)
nodes_st = st.lists(
    st.builds(
        Node,
        id=st.from_regex(r"10\.0\.0\.[0-9]{1,3}:[1-9][0-9]{3}", fullmatch=True),
        weight=st.floats(0.5, 8.0),
        zone=st.sampled_from(["", "a", "b", "c"]),
    ),
    min_size=1,
    max_size=12,
    unique_by=lambda n: n.id,
)


def keyset(n: int, seed: int = 1) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(16) for _ in range(n)]


@settings(max_examples=200, deadline=None)
@given(key=keys_st, nodes=nodes_st, replicas=st.integers(1, 4))
def test_cluster_rank_is_a_deterministic_permutation(key, nodes, replicas):
    r = rank(key, nodes, replicas)
    assert sorted(n.id for n in r) == sorted(n.id for n in nodes)
    assert r == rank(key, list(reversed(nodes)), replicas)  # input order does not matter
    top = owners(key, nodes, replicas)
    assert len({n.id for n in top}) == len(top) == min(replicas, len(nodes))


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(keys_st, max_size=20), nodes=nodes_st, replicas=st.integers(1, 4), tie=st.booleans())
def test_cluster_rank_many_is_rank_of_each_key(keys, nodes, replicas, tie):
    """The batch ranking gives every key rank's order, equal-weight ties and zones included."""
    if tie:  # equal weights: scores differ only through the hash
        nodes = [Node(n.id, 1.0, n.zone) for n in nodes]
    got = rank_many(keys, nodes, replicas)
    assert got == [tuple(n.id for n in rank(k, nodes, replicas)) for k in keys]
    with pytest.raises(ValueError, match="unique"):
        rank_many(keys, [*nodes, nodes[0]], replicas)


@settings(max_examples=200, deadline=None)
@given(key=keys_st, nodes=nodes_st, replicas=st.integers(1, 4))
def test_cluster_owners_use_distinct_zones_while_there_are_enough(key, nodes, replicas):
    zones = {n.zone for n in nodes}
    if not any(zones - {""}):
        return
    top = owners(key, nodes, replicas)
    assert len({n.zone for n in top}) == min(len(top), len(zones))


@settings(max_examples=100, deadline=None)
@given(key=keys_st, nodes=nodes_st, extra=st.integers(1000, 9999))
def test_cluster_a_join_only_takes_keys_for_itself(key, nodes, extra):
    """Without zones, a join changes a key's order only by inserting the new node."""
    plain = [Node(n.id, n.weight) for n in nodes]
    new = Node(f"10.9.9.9:{extra}", 1.0)
    before = [n.id for n in rank(key, plain)]
    after = [n.id for n in rank(key, [*plain, new])]
    after.remove(new.id)
    assert before == after


@pytest.mark.parametrize("n_nodes", [3, 10])
def test_cluster_join_and_leave_move_about_one_nth(n_nodes):
    keys = keyset(20000)
    nodes = [Node(f"10.0.0.{i}:7000") for i in range(n_nodes)]
    joined = [*nodes, Node("10.0.1.1:7000")]
    before = [owners(k, nodes, 1)[0].id for k in keys]
    after = [owners(k, joined, 1)[0].id for k in keys]
    moved = sum(a != b for a, b in zip(before, after)) / len(keys)
    assert abs(moved - 1 / (n_nodes + 1)) < 0.02
    assert all(b == a for a, b in zip(after, before) if a != "10.0.1.1:7000")  # moves only to the new node
    left = [owners(k, nodes[1:], 1)[0].id for k in keys]
    moved = sum(a != b for a, b in zip(before, left)) / len(keys)
    assert abs(moved - 1 / n_nodes) < 0.02


def test_cluster_replica_sets_move_about_one_nth_on_join():
    """With replicas=2 a join takes over about 2/(N+1) of the replica slots, no more."""
    keys = keyset(20000, seed=2)
    nodes = [Node(f"10.0.0.{i}:7000") for i in range(3)]
    joined = [*nodes, Node("10.0.1.1:7000")]
    changed = 0
    for k in keys:
        b = {n.id for n in owners(k, nodes, 2)}
        a = {n.id for n in owners(k, joined, 2)}
        assert len(a - b) <= 1 and (not a - b or a - b == {"10.0.1.1:7000"})
        changed += len(a - b)
    assert abs(changed / len(keys) - 2 / 4) < 0.03


def test_cluster_shares_follow_weights():
    keys = keyset(40000, seed=3)
    nodes = [Node("a:1", 1.0), Node("b:1", 2.0), Node("c:1", 4.0), Node("d:1", 1.0)]
    counts = {n.id: 0 for n in nodes}
    for k in keys:
        counts[owners(k, nodes, 1)[0].id] += 1
    total = sum(n.weight for n in nodes)
    for n in nodes:
        assert abs(counts[n.id] / len(keys) - n.weight / total) < 0.015


def test_cluster_max_over_mean_load_is_small():
    keys = keyset(50000, seed=4)
    nodes = [Node(f"10.0.{i // 250}.{i % 250}:7000") for i in range(50)]
    counts: dict[str, int] = {}
    for k in keys:
        a = owners(k, nodes, 1)[0].id
        counts[a] = counts.get(a, 0) + 1
    assert max(counts.values()) / (len(keys) / len(nodes)) < 1.2


def test_cluster_zone_spread_with_two_zones():
    nodes = [Node("a1:1", zone="a"), Node("a2:1", zone="a"), Node("a3:1", zone="a"), Node("b1:1", zone="b")]
    for k in keyset(2000, seed=5):
        assert {n.zone for n in owners(k, nodes, 2)} == {"a", "b"}


def test_cluster_bad_input_is_named():
    with pytest.raises(ValueError, match="weight"):
        Node("a:1", 0)
    with pytest.raises(ValueError, match="replicas"):
        rank(b"k" * 16, [Node("a:1")], 0)
    with pytest.raises(ValueError, match="unique"):
        rank(b"k" * 16, [Node("a:1"), Node("a:1")])
    with pytest.raises(MembershipError, match="'nohost'"):
        Member("nohost")
    with pytest.raises(MembershipError, match="duplicate"):
        StaticMembership(["a:1", "a:1"])
    with pytest.raises(MembershipError, match="bad member record"):
        Member.from_json(b"{}")
    m = Member("10.1.2.3:7000", 2 << 30, "z1", "n1")
    assert Member.from_json(m.to_json()) == m and m.node.weight == 2.0


@pytest.mark.parametrize("bad", ["nohost", ":7000", "h:", "h:x", "h:0", "h:65536", "h:-1"])
def test_every_address_reader_refuses_a_bad_host_port_naming_it(bad):
    """One parser (kvstore/address.py) behind the node client, a member and an etcd URL."""
    with pytest.raises(AddressError, match=repr(bad)):
        parse_host_port(bad, "node address")
    with pytest.raises(MembershipError, match=f"member address {bad!r}"):
        Member(bad)
    with pytest.raises(MembershipError, match=f"endpoint {bad!r}"):
        parse_etcd_url(f"etcd://{bad}/c")
    with pytest.raises(ValueError, match=f"node address {bad!r}"):
        NodeClient(bad)


def test_host_port_accepts_names_v4_and_bracketed_v6():
    assert parse_host_port("node-1.example:7000") == ("node-1.example", 7000)
    assert parse_host_port("10.0.0.1:1") == ("10.0.0.1", 1)
    assert parse_host_port("[::1]:65535") == ("::1", 65535)
    assert Member("[::1]:7000").addr == "[::1]:7000"
    assert parse_etcd_url("etcd://a:2379,[::1]:2379/c").endpoints == ("a:2379", "[::1]:2379")


@pytest.mark.parametrize("weights, zones", [(False, False), (True, False), (True, True)])
def test_cluster_bulk_ranking_of_a_long_prompt_is_rank_of_each_key(weights, zones):
    """rank_positions over 8,192 keys (numpy scores, exact rescoring of near ties) gives
    every key rank()'s order."""
    rnd = random.Random(11)
    nodes = [
        Node(f"10.1.0.{i}:7000", rnd.uniform(0.5, 4.0) if weights else 1.0, "ab"[i % 2] if zones else "")
        for i in range(5)
    ]
    keys = keyset(8192, 12)
    ids, rows = rank_positions(KeyBatch(b"".join(keys)), nodes, 2)
    assert rows.shape == (8192, 5)
    got = [tuple(ids[j] for j in row) for row in rows.tolist()]
    assert got == [tuple(n.id for n in rank(k, nodes, 2)) for k in keys]
