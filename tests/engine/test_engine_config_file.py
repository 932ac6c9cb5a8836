"""``kvengine --config FILE``: the engine's settings come from the store's layered loader
(defaults < ``[engine]`` table < ``TIERKV_ENGINE__*`` < flags); sizes use the one parser; a bad
setting names its key and source and is one line with status 2 (issue #14)."""

from __future__ import annotations

import pytest

from engine.cli import build_parser, load_settings, main
from kvstore.config import ConfigError

MiB = 2**20


@pytest.fixture(autouse=True)
def _no_engine_env(monkeypatch):
    # the developer's own TIERKV_ENGINE__* variables must not leak into these tests
    import os

    for name in list(os.environ):
        if name.startswith("TIERKV_ENGINE__"):
            monkeypatch.delenv(name)


def _settings(*argv: str):
    return load_settings(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize("text, n", [("512MB", 512 * 10**6), ("512MiB", 512 * MiB), ("4096", 4096)])
def test_kv_cache_bytes_units(text, n):
    s = _settings("--model", "m", "--kv-cache-bytes", text)
    assert s.kv_cache_bytes == n and s.engine_config("cpu").kv_cache_bytes == n


def test_defaults_are_the_flags_defaults():
    s = _settings("--model", "m")
    assert (s.kv_cache_bytes, s.page_size, s.num_pages, s.port, s.kv_connector) == (
        512 * MiB,
        16,
        None,
        8000,
        "none",
    )
    cfg = s.engine_config("cpu")
    assert cfg.enable_prefix_cache and cfg.kv_cache_dtype == "auto" and cfg.dtype is None
    assert _settings("--model", "m", "--no-prefix-cache").engine_config("cpu").enable_prefix_cache is False


def test_flags_over_env_over_file_over_defaults(tmp_path, monkeypatch):
    f = tmp_path / "engine.toml"
    f.write_text(
        "[engine]\n"
        'model = "from-file"\nkv_cache_bytes = "1GB"\npage_size = 32\nport = 9000\n'
        'kv_connector = "memory://?block_tokens=32"\nkv_cache_dtype = "fp8_e4m3"\nno_prefix_cache = true\n'
    )
    s = _settings("--config", str(f))
    assert (s.model, s.kv_cache_bytes, s.page_size, s.port) == ("from-file", 10**9, 32, 9000)
    assert s.kv_connector == "memory://?block_tokens=32" and s.kv_cache_dtype == "fp8_e4m3"
    assert s.engine_config("cpu").enable_prefix_cache is False
    monkeypatch.setenv("TIERKV_ENGINE__KV_CACHE_BYTES", "2GiB")
    monkeypatch.setenv("TIERKV_ENGINE__PORT", "9100")
    monkeypatch.setenv("TIERKV_DRAM__CAPACITY", "not the engine's")  # another role's: skipped
    s = _settings("--config", str(f))
    assert (s.model, s.kv_cache_bytes, s.port) == ("from-file", 2 << 30, 9100)
    s = _settings(
        "--config", str(f), "--kv-cache-bytes", "3MiB", "--model", "flag", "--kv-cache-dtype", "auto"
    )
    assert (s.model, s.kv_cache_bytes, s.port, s.kv_cache_dtype) == ("flag", 3 * MiB, 9100, "auto")


@pytest.mark.parametrize(
    "argv, env, toml, says",
    [
        (["--kv-cache-bytes", "12XB"], {}, "", "engine.kv_cache_bytes: '12XB' is not a size"),
        (["--kv-cache-bytes", "512K"], {}, "", "(flag --kv-cache-bytes)"),
        ([], {"TIERKV_ENGINE__KV_CACHE_BYTES": "-5"}, "", "(env TIERKV_ENGINE__KV_CACHE_BYTES)"),
        ([], {}, 'kv_cache_bytes = "1.5G"', "engine.kv_cache_bytes: '1.5G' is not a size"),
        ([], {}, "kv_cach_bytes = 5", "engine.kv_cach_bytes: unknown key (file "),
        ([], {"TIERKV_ENGINE__NOPE": "1"}, "", "engine.nope: unknown key (env TIERKV_ENGINE__NOPE"),
        (["--page-size", "12"], {}, "", "engine.page_size: page_size must be a positive power of two"),
        ([], {}, "page_size = 12", "(file "),
        (["--port", "eighty"], {}, "", "engine.port: expected an integer, got 'eighty' (flag --port)"),
        (["--dtype", "float8"], {}, "", "engine.dtype: expected one of"),
        (
            [],
            {"TIERKV_ENGINE__NO_PREFIX_CACHE": "maybe"},
            "",
            "engine.no_prefix_cache: expected true or false",
        ),
    ],
)
def test_bad_settings_name_key_and_source(tmp_path, monkeypatch, argv, env, toml, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    f = tmp_path / "engine.toml"
    f.write_text(f'[engine]\nmodel = "m"\n{toml}\n')
    with pytest.raises(ConfigError) as info:
        _settings("--config", str(f), *argv)
    assert says in str(info.value), str(info.value)


def test_the_model_is_required_from_some_source():
    with pytest.raises(ConfigError, match="engine.model: required"):
        _settings()


def test_main_reports_a_bad_setting_in_one_line_with_status_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--kv-cache-bytes", "12XB", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvengine: error: engine.kv_cache_bytes: '12XB'"), err


def test_serve_bad_size_is_one_line_and_status_2_in_a_real_process(tmp_path, cli_error_line):
    line = cli_error_line("serve", "--model", str(tmp_path), "--kv-cache-bytes", "512K")
    assert "engine.kv_cache_bytes: '512K' is not a size" in line, line


def test_generate_runs_from_a_config_file(tiny_model_dir, tmp_path, capsys):
    d = tiny_model_dir("llama-tiny")
    f = tmp_path / "engine.toml"
    f.write_text(f'[engine]\nmodel = "{d}"\ndevice = "cpu"\nkv_cache_bytes = "2MB"\npage_size = 8\n')
    assert main(["generate", "--config", str(f), "--prompt", "hi", "--max-tokens", "3"]) == 0
    assert "output_tokens=3" in capsys.readouterr().err


def test_timeline_layers_flag_file_and_default():
    assert _settings("--model", "m").timeline_layers is False
    assert _settings("--model", "m", "--timeline-layers").timeline_layers is True
