"""The one size parser (kvstore.config.parse_size: its whole unit table, refusals naming the key
and the value) and the layered loader's errors naming where a bad value came from (issue #14)."""

from __future__ import annotations

import pytest

from kvstore.config import ConfigError, Size, coerce, load_store_config, parse_size

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    "text, n",
    [
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        ("17B", 17),
        ("17b", 17),
        ("1KiB", KiB),
        ("2mib", 2 * MiB),
        ("3GIB", 3 * GiB),
        ("1TiB", TiB),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        ("1KB", 1000),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("2GB", 2 * 10**9),
        ("1Tb", 10**12),
        (" 64 MiB ", 64 * MiB),
    ],
)
def test_unit_table(text, n):
    assert parse_size(text, "x") == n


@pytest.mark.parametrize(
    "bad",
    ["K", "4k", "4K", "1.5G", "12XB", "1PiB", "-5", "-5MiB", "", "MiB", "1e9", "1.5B", "lots", -1, 1.5, True],
)
def test_bad_sizes_name_the_key_and_the_value(bad):
    with pytest.raises(ConfigError) as info:
        parse_size(bad, "dram.capacity")
    msg = str(info.value)
    assert msg.startswith("dram.capacity:") and (repr(bad) in msg or str(bad) in msg), msg


def test_store_config_sizes_are_decimal_with_kb_and_binary_with_kib(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('[dram]\ncapacity = "512MB"\nslab_size = "1MiB"\n[disk]\nenabled = false\n')
    assert load_store_config(f, env={}).dram.capacity == 512 * 10**6
    env = {"TIERKV_DRAM__CAPACITY": "512MiB"}
    assert load_store_config(f, env=env).dram.capacity == 512 * MiB
    assert load_store_config(f, {"dram.capacity": "64MB"}, env={}).dram.capacity == 64 * 10**6


@pytest.mark.parametrize(
    "where, expect",
    [
        ("file", "(file "),
        ("env", "(env TIERKV_DRAM__CAPACITY)"),
        ("override", "(override dram.capacity)"),
    ],
)
def test_a_bad_size_names_key_value_and_source(tmp_path, where, expect):
    f = tmp_path / "node.toml"
    f.write_text("[disk]\nenabled = false\n" + ('[dram]\ncapacity = "12XB"\n' if where == "file" else ""))
    env = {"TIERKV_DRAM__CAPACITY": "12XB"} if where == "env" else {}
    over = {"dram.capacity": "12XB"} if where == "override" else {}
    with pytest.raises(ConfigError) as info:
        load_store_config(f, over, env=env)
    msg = str(info.value)
    assert msg.startswith("dram.capacity: '12XB' is not a size") and expect in msg, msg
    if where == "file":
        assert str(f) in msg


def test_unknown_keys_name_their_source(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('[dram]\ncapacty = "1GiB"\n')
    with pytest.raises(ConfigError, match=r"dram\.capacty: unknown key \(file .*node\.toml; known: "):
        load_store_config(f, {"disk.enabled": False}, env={})
    with pytest.raises(ConfigError, match=r"dram\.nope: unknown key \(env TIERKV_DRAM__NOPE; "):
        load_store_config(None, {"disk.enabled": False}, env={"TIERKV_DRAM__NOPE": "1"})
    with pytest.raises(ConfigError, match=r"dramm: unknown section \(override dramm\.capacity; "):
        load_store_config(None, {"disk.enabled": False, "dramm.capacity": 1}, env={})


def test_a_cross_check_names_the_source_of_its_key():
    # the pre-auth header limit is checked in __post_init__, after coercion
    env = {"TIERKV_LIMITS__MAX_HEADER_UNAUTHENTICATED": "100B"}
    with pytest.raises(ConfigError) as info:
        load_store_config(None, {"disk.enabled": False}, env=env)
    msg = str(info.value)
    assert (
        "limits.max_header_unauthenticated" in msg
        and "(env TIERKV_LIMITS__MAX_HEADER_UNAUTHENTICATED)" in msg
    )


@pytest.mark.parametrize(
    "tp, value, text, out",
    [
        (Size, "2KB", True, 2000),
        (Size, 7, False, 7),
        (int, "8", True, 8),
        (float, 2, False, 2.0),
        (float, "0.25", True, 0.25),
        (bool, "on", True, True),
        (bool, False, False, False),
        (int | None, "3", True, 3),
        (tuple[str, ...], "a, b", True, ("a", "b")),
    ],
)
def test_coerce_parses_text_and_checks_typed_values(tp, value, text, out):
    assert coerce("k", tp, value, text=text) == out


@pytest.mark.parametrize(
    "tp, value, text",
    [(int, "8", False), (bool, 1, False), (bool, "maybe", True), (float, "soon", True), (int, 2.5, False)],
)
def test_coerce_refusals_name_the_key(tp, value, text):
    with pytest.raises(ConfigError, match=r"^k: expected"):
        coerce("k", tp, value, text=text)


def test_connector_url_and_toml_sizes_use_the_same_parser(tmp_path):
    from connector.config import parse_connector_url

    f = tmp_path / "conn.toml"
    f.write_text('save_queue_bytes = "512MB"\ndram_capacity = "1GiB"\npolicy = "never"\n')
    cfg = parse_connector_url(f"local://{tmp_path}/s?config={f}&disk_capacity=2GB")
    assert (cfg.save_queue_bytes, cfg.dram_capacity, cfg.disk_capacity) == (512 * 10**6, GiB, 2 * 10**9)
    assert cfg.policy == "never"
    with pytest.raises(ConfigError, match=r"option dram_capacity: '4k' is not a size .*\(URL query\)"):
        parse_connector_url(f"local://{tmp_path}/s?dram_capacity=4k")
    f.write_text("load_parallel = true\n")
    with pytest.raises(ConfigError, match=r"option load_parallel: expected an integer, got True \(file "):
        parse_connector_url(f"local://{tmp_path}/s?config={f}")
