"""deploy/ cannot rot: every example config loads into the config schema, and every command,
flag, environment override and connector URL used by the systemd units and Kubernetes
manifests exists in the CLIs and the schema."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest

from connector.config import parse_connector_url
from kvstore.config import StoreConfig, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def check_kvstore_args(args: list[str]) -> None:
    from kvstore.cli import build_parser

    ns = build_parser().parse_args(args)
    assert ns.command == "serve"


def check_engine_args(args: list[str]) -> None:
    from engine.cli import build_parser

    ns = build_parser().parse_args(args)
    if ns.kv_connector not in ("none", ""):
        parse_connector_url(ns.kv_connector)


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.toml")), ids=lambda p: p.name)
def test_cluster_deploy_example_configs_load(path):
    load_config(StoreConfig, path, env={})


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.service")), ids=lambda p: p.name)
def test_cluster_deploy_systemd_units(path):
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(path)
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name in ("kvstore", "kvengine")
    (check_kvstore_args if Path(argv[0]).name == "kvstore" else check_engine_args)(argv[1:])
    assert unit["Service"]["KillSignal"] == "SIGTERM" and unit["Service"]["Restart"] == "on-failure"
    assert unit["Service"]["User"] and unit["Service"]["StateDirectory"]


def _containers(doc) -> list[dict]:
    spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: p.name)
def test_cluster_deploy_manifests(path, tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML parses deploy/k8s (a dev dependency)")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs and all("kind" in d and "apiVersion" in d for d in docs)
    configs = {}
    for d in docs:
        if d["kind"] == "ConfigMap":
            for name, text in d["data"].items():
                if name.endswith(".toml"):
                    f = tmp_path / name
                    f.write_text(text)
                    configs[name] = f
                    load_config(StoreConfig, f, env={})
    for d in docs:
        for c in _containers(d):
            argv = [*c.get("command", []), *c.get("args", [])]
            env = {e["name"]: e.get("value", "x").replace("$(POD_IP)", "10.0.0.1") for e in c.get("env", [])}
            if argv and argv[0] == "kvstore":
                check_kvstore_args(argv[1:])
                cfg_path = configs.get("node.toml")
                tier = {k: v for k, v in env.items() if k.startswith("TIERKV_")}
                # every TIERKV_ override names a real key (unknown sections are other roles')
                for name in tier:
                    sec, _, key = name.removeprefix("TIERKV_").lower().partition("__")
                    assert sec in StoreConfig.__dataclass_fields__, name
                load_config(StoreConfig, cfg_path, env=tier)
            elif argv and argv[0] == "kvengine":
                check_engine_args(argv[1:])
