"""The vLLM connector's parts that need no vLLM (they run in the main venv): its options come
from ``kv_connector_extra_config`` through kvengine's one parser, and its page format keys
blocks apart from the bundled engine's and from every other format."""

from __future__ import annotations

import dataclasses

import pytest

from connector.config import parse_connector_url
from connector.vllm_format import PageFormat, model_identity
from kvstore.client import ConfigError
from kvstore.keys import Namespace

SOURCE = "kv_connector_extra_config"
FMT = PageFormat(
    model="m" * 32,
    compute_dtype="float32",
    kv_dtype="float32",
    backend="CPU_ATTN/vec",
    kv_layout="LBHNC",
    page_shape=(3, 32, 128),
    layers=30,
    block_size=32,
)


def test_extra_config_values_are_typed_like_toml_and_the_url_query_wins():
    cfg = parse_connector_url(
        "kvstore://127.0.0.1:7000?policy=never",
        options={"policy": "always", "save_queue_bytes": "64MiB", "lookup_deadline_s": 1, "token": "t"},
        options_source=SOURCE,
    )
    assert (cfg.policy, cfg.save_queue_bytes, cfg.lookup_deadline_s, cfg.token) == (
        "never",
        64 << 20,
        1.0,
        "t",
    )


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"bogus": 1}, "unknown option 'bogus'"),
        ({"load_deadline_s": "soon"}, "load_deadline_s: expected a number"),
    ],
)
def test_a_bad_extra_config_key_or_value_is_named_with_its_source(options, says):
    with pytest.raises(ConfigError, match=says) as err:
        parse_connector_url("kvstore://127.0.0.1:7000", options=options, options_source=SOURCE)
    assert SOURCE in str(err.value)


def test_every_field_of_the_page_format_changes_the_namespace():
    base = FMT.namespace(32).id
    changed = {
        "model": "n" * 32,
        "compute_dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "backend": "CPU_ATTN/amx",
        "kv_layout": "LBNHC",
        "page_shape": (3, 32, 64),
        "layers": 29,
        "tp_size": 2,
    }
    for field, value in changed.items():
        assert dataclasses.replace(FMT, **{field: value}).namespace(32).id != base, field
    assert (
        dataclasses.replace(FMT, tp_size=2, tp_rank=1).namespace(32).id
        != dataclasses.replace(FMT, tp_size=2).namespace(32).id
    )


def test_the_bundled_engines_namespace_of_the_same_model_is_another():
    bundled = Namespace(FMT.model, FMT.kv_dtype, 32)  # layout LKTHD, as kvengine keys
    assert FMT.namespace(32).id != bundled.id
    assert FMT.namespace(32).layout.startswith("vllm:")


def test_a_block_is_one_vllm_block():
    with pytest.raises(ConfigError, match="block_size 32"):
        FMT.namespace(64)
    assert FMT.block_shape == (30, 3, 32, 128) and FMT.block_bytes == 30 * 3 * 32 * 128 * 4


def test_a_model_without_a_local_folder_asks_for_a_fingerprint(tmp_path):
    with pytest.raises(ConfigError, match="model_fingerprint"):
        model_identity(str(tmp_path / "nowhere"), None, None)
    assert model_identity("any", None, None, "named") == "named"
    assert model_identity("any", None, {"architectures": ["X"]}, "named") != "named"
