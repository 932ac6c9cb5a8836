"""Config: TOML, then TIERKV_* environment, then overrides; errors name the key."""

from __future__ import annotations

import pytest

from kvstore.config import ConfigError, format_size, load_store_config, parse_size


def test_layers_and_types(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text(
        '[dram]\ncapacity = "2GiB"\nslab_size = "16MiB"\n'
        '[disk]\npath = "/srv/kv"\nsync = false\nwrite_mode = "write-back"\n'
        "[server]\ndata_port = 7000\n"
    )
    env = {"TIERKV_DRAM__CAPACITY": "3GiB", "TIERKV_DISK__SYNC": "true", "TIERKV_UNRELATED": "x"}
    cfg = load_store_config(f, {"server.data_port": 7100}, env=env)
    assert cfg.dram.capacity == 3 * 2**30 and cfg.dram.slab_size == 16 * 2**20
    assert cfg.disk.sync is True and cfg.disk.write_mode == "write-back" and cfg.disk.path == "/srv/kv"
    assert cfg.server.data_port == 7100
    with pytest.raises(AttributeError):
        cfg.dram.capacity = 1  # frozen


@pytest.mark.parametrize(
    "toml, word",
    [
        ('[dram]\ncapacty = "1GiB"', "dram.capacty: unknown key"),
        ('[dramm]\ncapacity = "1GiB"', "dramm: unknown section"),
        ('[dram]\ncapacity = "lots"', "dram.capacity"),
        ("[dram]\ncapacity = -5", "dram.capacity"),
        ("[disk]\nsync = 1", "disk.sync"),
        ('[disk]\nwrite_mode = "sometimes"', "disk.write_mode"),
        ('[server]\ndata_port = "80"', "server.data_port"),
        ('[dram]\ncapacity = "1MiB"', "dram.capacity"),
        ("[disk\n", "not valid TOML"),
    ],
)
def test_errors_name_the_key(tmp_path, toml, word):
    f = tmp_path / "bad.toml"
    f.write_text(toml + '\n[disk]\npath = "/x"\n' if "[disk]" not in toml and toml != "[disk\n" else toml)
    with pytest.raises(ConfigError, match=word.replace("[", r"\[").replace(".", r"\.")):
        load_store_config(f, {"disk.path": "/x"}, env={})


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("limits.idle_timeout_s", 0, "must be > 0, got 0"),
        ("limits.send_buffer", 0, "must be >= 1, got 0"),
        ("repair.replicas", 0, "must be >= 1, got 0"),
        ("repair.deadline_s", float("nan"), "must be > 0, got nan"),
        ("repair.settle_s", -1, "must be >= 0, got -1"),
        ("orphans.slice_blocks", 0, "must be >= 1, got 0"),
        ("orphans.lookahead", -1, "must be >= 0, got -1"),
        ("orphans.departed_s", 0, "must be > 0, got 0"),
        ("tombstones.per_tenant", 0, "must be >= 1, got 0"),
        ("tombstones.max_age_s", -1, "must be > 0, got -1"),
    ],
)
def test_bounds_name_the_key_and_the_bound(key, value, says):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ": " + says.replace(".", r"\.")):
        load_store_config(None, {"disk.enabled": False, key: value}, env={})
    load_store_config(None, {"disk.enabled": False}, env={})  # the defaults are within bounds


def test_env_errors_name_the_key():
    with pytest.raises(ConfigError, match="disk.sync"):
        load_store_config(None, {"disk.path": "/x"}, env={"TIERKV_DISK__SYNC": "maybe"})
    with pytest.raises(ConfigError, match="dram.nope"):
        load_store_config(None, {"disk.path": "/x"}, env={"TIERKV_DRAM__NOPE": "1"})


def test_missing_file_and_required_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_store_config(tmp_path / "none.toml", env={})
    with pytest.raises(ConfigError, match="disk.path"):
        load_store_config(None, env={})
    cfg = load_store_config(None, {"disk.enabled": False}, env={})
    assert cfg.disk.enabled is False


@pytest.mark.parametrize(
    "text, n",
    [("64GiB", 64 << 30), ("512MiB", 512 << 20), ("4KiB", 4096), ("1.5GiB", 3 << 29), (123, 123), ("7", 7)],
)
def test_sizes(text, n):
    # the whole unit table (decimal units, refused spellings): tests/store/test_sizes_and_config.py
    assert parse_size(text) == n


def test_format_size():
    assert format_size(0) == "0B" and format_size(1536) == "1.5KiB" and format_size(3 << 30) == "3.0GiB"


def test_limits_have_safe_defaults_and_bad_values_name_the_key(tmp_path):
    base = {"disk.enabled": False}
    lim = load_store_config(None, base, env={}).limits
    assert (lim.hello_timeout_s, lim.max_unauthenticated, lim.max_header_unauthenticated) == (
        10.0,
        64,
        64 << 10,
    )
    assert lim.max_lease_ttl_s <= 300 and lim.max_leases_per_conn >= 1
    got = load_store_config(
        None, {**base, "limits.idle_timeout_s": 5}, env={"TIERKV_LIMITS__MAX_CONNS_PER_TENANT": "9"}
    )
    assert (got.limits.idle_timeout_s, got.limits.max_conns_per_tenant) == (5.0, 9)
    for key, bad, says in (
        ("limits.transfer_timeout_s", 0, "limits.transfer_timeout_s"),
        ("limits.max_unauthenticated", 0, "limits.max_unauthenticated"),
        ("limits.max_header_unauthenticated", "100B", "limits.max_header_unauthenticated"),
        ("limits.max_lease_ttl_s", "long", "limits.max_lease_ttl_s"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_store_config(None, {**base, key: bad}, env={})
