"""The one config loader of every role (the store's ``kvstore serve``, the in-process node,
the engine's ``kvengine``, the connector's URL): a TOML file, then ``TIERKV_*`` environment
variables, then explicit overrides and command-line flags, parsed into frozen dataclasses.

An unknown key or a bad value is a :class:`ConfigError` naming the key (``dram.capacity``) and
where the value came from (the file, the variable, the flag), never a warning. Sizes go
through :func:`parse_size`, the project's one size parser (docs/configuration.md has its unit
table). Environment variables name a key as ``TIERKV_<SECTION>__<KEY>``
(``TIERKV_DRAM__CAPACITY=2GiB``, ``TIERKV_ENGINE__KV_CACHE_BYTES=8GiB``).

One mechanism shared by roles that may not import each other, so it imports only the standard
library and :mod:`kvstore.errors` (tests/test_import_graph.py holds that): the engine imports
it and :mod:`kvstore.keys`, nothing else of kvstore. The store's own sections live in
:mod:`kvstore.config`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from kvstore.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "SIZE_UNITS",
    "ConfigError",
    "Size",
    "check_floor",
    "coerce",
    "format_size",
    "load_config",
    "parse_size",
]

ENV_PREFIX = "TIERKV_"

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
# the whole unit table, matched case-insensitively: IEC units are binary, SI units decimal;
# a bare K/M/G is refused because half the world reads it one way and half the other
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_HELP = "a byte count, or a number with B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)"


def parse_size(value: Any, name: str = "size") -> int:
    """A size in bytes: an int >= 0, or text: a number (bytes) or a number and a unit of
    ``SIZE_UNITS`` (case-insensitive): ``B``; ``KiB MiB GiB TiB`` = 2^10..2^40;
    ``KB MB GB TB`` = 10^3..10^12. ``"1.5GiB"`` is fine; a result that is not a whole number
    of bytes is not. Raises ConfigError naming ``name`` and the value for anything else (a bare
    ``K``, ``12XB``, a negative number, a bool or float)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{name}: a size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and m.group(2).lower() in SIZE_UNITS:
            n = Decimal(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
            if n != n.to_integral_value():
                raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
            return int(n)
    raise ConfigError(f"{name}: {value!r} is not a size ({_SIZE_HELP})")


def check_floor(
    section: str, obj: object, low: float, names: tuple[str, ...], *, strict: bool = False
) -> None:
    """A section's bounds check: ConfigError ``{section}.{name}: must be >= {low}, got ...``
    (``strict``: ``> {low}``) for the first field of ``names`` on ``obj`` whose value is not
    (NaN included)."""
    for name in names:
        value = getattr(obj, name)
        if not (value > low if strict else value >= low):
            raise ConfigError(f"{section}.{name}: must be {'>' if strict else '>='} {low}, got {value}")


def format_size(n: float) -> str:
    """Bytes as a short human string: ``format_size(3*2**30) == '3.0GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}PiB"  # pragma: no cover


class Size(int):
    """Marker type for size fields: parsed with :func:`parse_size`."""


@dataclass(frozen=True)
class _Value:
    """One setting from one source: ``text`` values (environment, flags, URL queries) are
    parsed into the field's type; others (TOML, Python) must already have it."""

    value: Any
    source: str  # "file node.toml", "env TIERKV_DRAM__CAPACITY", "flag --kv-cache-bytes"
    text: bool


def load_config(
    cls: type,
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    flags: Mapping[str, tuple[str, str]] | None = None,
):
    """Build ``cls`` (a frozen dataclass of section dataclasses) from, in rising priority: its
    defaults, the TOML file at ``path``, ``TIERKV_SECTION__KEY`` variables in ``env`` (pass
    ``os.environ`` explicitly; None means none; variables of sections ``cls`` lacks belong to
    other roles and are skipped), ``overrides`` (``{"dram.capacity": "1GiB"}``, typed as TOML
    values are) and ``flags`` (``{"engine.page_size": ("--page-size", "16")}``: command-line
    text, parsed as environment values are). Raises ConfigError naming the key and its source
    on any unknown key or bad value, and naming the file when it is missing or not TOML."""
    sections = {f.name: f for f in dataclasses.fields(cls)}
    merged: dict[str, dict[str, _Value]] = {s: {} for s in sections}

    def put(sec: str, key: str, v: _Value) -> None:
        if sec not in sections:
            raise ConfigError(f"{sec}: unknown section ({v.source}; known: {', '.join(sections)})")
        if not key:
            raise ConfigError(f"{sec}: a key is missing ({v.source})")
        merged[sec][key] = v

    if path is not None:
        src = f"file {os.fspath(path)}"
        for sec, table in _read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{sec}: expected a table ({src})")
            for key, value in table.items():
                put(sec, key, _Value(value, src, False))
    for name, value in (env or {}).items():
        sec, sep, key = name.removeprefix(ENV_PREFIX).lower().partition("__")
        if name.startswith(ENV_PREFIX) and sep and sec in sections:
            put(sec, key, _Value(value, f"env {name}", True))
    for dotted, value in (overrides or {}).items():
        sec, _, key = dotted.partition(".")
        put(sec, key, _Value(value, f"override {dotted}", False))
    for dotted, (flag, text) in (flags or {}).items():
        sec, _, key = dotted.partition(".")
        put(sec, key, _Value(text, f"flag {flag}", True))
    built = {sec: _build_section(sec, _resolve(f.type, cls), merged[sec]) for sec, f in sections.items()}
    try:
        return cls(**built)
    except TypeError as exc:  # pragma: no cover - programming error
        raise ConfigError(str(exc)) from exc


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {os.fspath(path)!r} is not valid TOML: {exc}") from exc


def _resolve(tp, owner):
    if isinstance(tp, str):
        hints = typing.get_type_hints(owner)
        return hints[tp] if tp in hints else eval(tp, vars(sys.modules[owner.__module__]))  # noqa: S307
    return tp


def _build_section(sec: str, sec_cls: type, values: dict[str, _Value]):
    hints = typing.get_type_hints(sec_cls)
    known = {f.name for f in dataclasses.fields(sec_cls)}
    kwargs = {}
    for key, v in values.items():
        if key not in known:
            raise ConfigError(f"{sec}.{key}: unknown key ({v.source}; known: {', '.join(sorted(known))})")
        try:
            kwargs[key] = coerce(f"{sec}.{key}", hints[key], v.value, text=v.text)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({v.source})") from None
    try:
        return sec_cls(**kwargs)
    except ConfigError as exc:
        # a check across values (__post_init__) names its key: say where that value came from
        msg = str(exc)
        key = next((k for k in values if msg.startswith(f"{sec}.{k}:")), None)
        if key is None:
            raise
        raise ConfigError(f"{msg} ({values[key].source})") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{sec}: {exc}") from exc


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def coerce(name: str, tp: Any, value: Any, *, text: bool = False) -> Any:
    """``value`` as a field of type ``tp``: int, float, bool, str, :class:`Size`,
    ``Literal[...]``, ``tuple[X, ...]`` or ``X | None``. ``text``: the value arrived as text (an
    environment variable, a flag, a URL query) and is parsed (``"8"`` -> 8, ``"on"`` -> True,
    ``"a,b"`` -> a tuple); otherwise (TOML, Python) it must already have the type, save that
    an int is a float too. The one coercion of every config source: the store's and engine's
    loader and the connector's URL. Raises ConfigError naming ``name`` and the value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:  # pragma: no cover - programming error
            raise ConfigError(f"{name}: only X | None unions are supported in config")
        return coerce(name, args[0], value, text=text)
    if tp is Size:
        return Size(parse_size(value, name))
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and "true" in choices:
            value = "true" if value else "false"
        if value not in choices:
            raise ConfigError(f"{name}: expected one of {list(choices)}, got {value!r}")
        return str(value)
    if tp is bool:
        if isinstance(value, bool) and not text:
            return value
        if text and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp in (int, float):
        if text:
            try:
                return tp(value)
            except ValueError:
                pass
        elif isinstance(value, (int, tp)) and not isinstance(value, bool):
            return tp(value)
        kind = "an integer" if tp is int else "a number"
        raise ConfigError(f"{name}: expected {kind}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if origin is tuple:  # tuple[X, ...]
        item = typing.get_args(tp)[0]
        if text:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(coerce(f"{name}[{i}]", item, v, text=text) for i, v in enumerate(value))
    raise ConfigError(f"{name}: unsupported field type {tp!r}")  # pragma: no cover
