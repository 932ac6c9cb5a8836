"""Block keys: chained, deterministic across processes, sensitive to every namespace field."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import KeyFormatError
from kvstore.keys import (
    BlockKey,
    Namespace,
    block_spans,
    model_fingerprint,
    tokens_from_le_bytes,
    tokens_le_bytes,
)

NS = Namespace("fp", "bfloat16", 16)
tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=200)

_CHILD = """
import json, sys
from kvstore.keys import Namespace
ns = Namespace("fp", "bfloat16", 16, tenant_salt="t1", hash=sys.argv[1])
print(json.dumps([k.hex for k in ns.block_keys(list(range(1000)))] + [ns.id.hex]))
"""


@pytest.mark.parametrize("hash_name", ["xxh3_128", "blake2b_128"])
def test_keys_identical_across_processes(hash_name):
    """Real subprocesses with different hash seeds produce the same keys as this process."""
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _CHILD, hash_name], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    ns = Namespace("fp", "bfloat16", 16, tenant_salt="t1", hash=hash_name)
    here = [k.hex for k in ns.block_keys(list(range(1000)))] + [ns.id.hex]
    assert outs[0] == outs[1] == here
    assert len(here) == 1000 // 16 + 1


def test_known_vector_is_stable():
    """Pin one key so an accidental change of the key format fails loudly (it would orphan
    every stored block)."""
    ns = Namespace("fp", "bfloat16", 4)
    assert ns.block_keys([1, 2, 3, 4])[0] == ns.next_key(ns.id, [1, 2, 3, 4])
    assert ns.id.hex == Namespace("fp", "bfloat16", 4).id.hex
    assert ns.block_keys([1, 2, 3, 4])[0].hex == "1077adb83cca55bfbc7d827d085d278b"


def test_formula_matches_design():
    """key_i = xxh3_128(key_{i-1} || le_int32(tokens)), key_{-1} = xxh3_128(namespace)."""
    ns = Namespace("fp", "bfloat16", 2)
    root = xxhash.xxh3_128_digest(ns.canonical())
    k0 = xxhash.xxh3_128_digest(root + struct.pack("<2i", 7, -3))
    k1 = xxhash.xxh3_128_digest(k0 + struct.pack("<2i", 70000, 0))
    assert [k.raw for k in ns.block_keys([7, -3, 70000, 0, 5])] == [k0, k1]
    b = Namespace("fp", "bfloat16", 2, hash="blake2b_128")
    broot = hashlib.blake2b(b.canonical(), digest_size=16).digest()
    assert (
        b.block_keys([7, -3])[0].raw
        == hashlib.blake2b(broot + struct.pack("<2i", 7, -3), digest_size=16).digest()
    )


@given(tokens_st, st.integers(1, 9))
def test_prefix_property(tokens, cut):
    """Keys of a prefix are the leading keys of the whole; partial tail blocks get none."""
    ns = Namespace("fp", "float16", cut)
    keys = ns.block_keys(tokens)
    assert len(keys) == len(tokens) // cut
    for n in range(len(keys) + 1):
        assert ns.block_keys(tokens[: n * cut]) == keys[:n]
    assert [e - s for s, e in block_spans(len(tokens), cut)] == [cut] * len(keys)


@given(tokens_st)
def test_token_bytes_roundtrip(tokens):
    assert tokens_from_le_bytes(tokens_le_bytes(tokens)) == tokens


def test_chain_depends_on_all_previous_blocks():
    a = NS.block_keys(list(range(64)))
    b = NS.block_keys([999] + list(range(1, 64)))
    assert all(x != y for x, y in zip(a, b))


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "other"},
        {"kv_dtype": "float16"},
        {"block_tokens": 32},
        {"layout": "other"},
        {"tp_size": 2, "tp_rank": 1},
        {"tenant_salt": "tenant-b"},
        {"hash": "blake2b_128"},
    ],
)
def test_every_namespace_field_changes_keys(change):
    base = dict(model_fingerprint="fp", kv_dtype="bfloat16", block_tokens=16)
    other = Namespace(**{**base, **change})
    toks = list(range(64))
    assert other.id != NS.id
    assert set(other.block_keys(toks)).isdisjoint(NS.block_keys(toks))


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"model_fingerprint": ""}, "model_fingerprint"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"hash": "md5"}, "hash"),
    ],
)
def test_bad_namespace_names_the_field(kwargs, word):
    base = dict(model_fingerprint="fp", kv_dtype="bfloat16", block_tokens=16)
    with pytest.raises(KeyFormatError, match=word):
        Namespace(**{**base, **kwargs})


def test_with_tenant_changes_only_the_salt():
    base = Namespace("fp", "float16", 32, layout="LKTHD-fp8", tp_size=4, tp_rank=3, hash="blake2b_128")
    t = base.with_tenant("acme")
    assert t == Namespace("fp", "float16", 32, "LKTHD-fp8", 4, 3, "acme", "blake2b_128")
    assert t.id == Namespace("fp", "float16", 32, "LKTHD-fp8", 4, 3, "acme", "blake2b_128").id != base.id
    assert t.with_tenant("") == base and t.with_tenant("").id == base.id


def test_bad_inputs():
    with pytest.raises(KeyFormatError, match="int32"):
        NS.block_keys([2**31] * 16)
    with pytest.raises(KeyFormatError):
        BlockKey(b"short")
    with pytest.raises(KeyFormatError, match="not hex"):
        BlockKey.from_hex("zz")
    with pytest.raises(KeyFormatError, match="16 tokens"):
        NS.next_key(NS.id, [1, 2])
    assert BlockKey.from_hex(NS.id.hex) == NS.id


def test_model_fingerprint_sees_weights(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text(json.dumps({"hidden_size": 8, "model_type": "llama"}))
    (tmp_path / "a" / "model.safetensors").write_bytes(b"\x00" * 300_000)
    (tmp_path / "b" / "model.safetensors").write_bytes(b"\x00" * 150_000 + b"\x01" + b"\x00" * 149_999)
    fa, fb = model_fingerprint(tmp_path / "a"), model_fingerprint(tmp_path / "b")
    assert fa != fb, "two fine-tunes of one architecture must not share blocks"
    assert fa == model_fingerprint(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_fingerprint(tmp_path)
