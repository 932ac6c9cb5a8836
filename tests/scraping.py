"""The suite's one metrics scraper: Prometheus text (a daemon's admin ``/metrics``, the
engine's ``/metrics``, a registry's ``generate_latest``) parsed into samples with labels by
prometheus_client's own parser, so a test asks for a value by name and labels instead of
matching rendered lines."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_ABSENT: Any = object()


@dataclass(frozen=True)
class Sample:
    name: str  # as rendered: a counter's "_total", a histogram's "_bucket"/"_count"/"_sum"
    labels: MappingProxyType
    value: float


class Scrape:
    """One scrape. ``value``/``has`` match a sample's labels exactly (every label named, no
    other); ``total`` and ``by`` look at every sample of a name whose labels include those
    given."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = tuple(
            Sample(s.name, MappingProxyType(dict(s.labels)), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )

    def of(self, name: str, **labels: str) -> list[Sample]:
        """The samples called ``name`` whose labels include ``labels``."""
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())
        ]

    def value(self, name: str, default: float = _ABSENT, **labels: str) -> float:
        """The value of the one sample ``name{labels}``. When there is none: ``default`` if
        given (a labelled counter not yet counted is not rendered at all), else
        AssertionError listing the samples of that name there are."""
        want = {k: str(v) for k, v in labels.items()}
        for s in self.samples:
            if s.name == name and dict(s.labels) == want:
                return s.value
        if default is not _ABSENT:
            return default
        seen = [f"{s.name}{dict(s.labels)} {s.value}" for s in self.of(name)]
        raise AssertionError(f"no sample {name}{want} on /metrics; of that name: {seen or 'none'}")

    def has(self, name: str, **labels: str) -> bool:
        return self.value(name, None, **labels) is not None

    def total(self, name: str, **labels: str) -> float:
        """The sum over every sample of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(s.value for s in self.of(name, **labels))

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """{value of ``label``: sample value} over the samples of ``name`` that carry it."""
        return {s.labels[label]: s.value for s in self.of(name, **labels) if label in s.labels}


def _url(base: str) -> str:
    return base if base.endswith("/metrics") else base.rstrip("/") + "/metrics"


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def scrape(base: str, token: str | None = None, timeout_s: float = 10.0) -> Scrape:
    """``GET base/metrics`` (``base``: a daemon's ``admin`` address or the engine server's;
    a URL ending in ``/metrics`` is taken as it is), with the operator ``token`` when auth is
    on. Blocks the thread: in a coroutine use ``scrape_async``."""
    req = urllib.request.Request(_url(base), headers=_headers(token))
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return Scrape(r.read().decode())


async def scrape_async(base: str, token: str | None = None, timeout_s: float = 10.0) -> Scrape:
    """``scrape`` without blocking the event loop."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.get(_url(base), headers=_headers(token)) as r:
        assert r.status == 200, f"GET {_url(base)}: {r.status}"
        return Scrape(await r.text())


async def scrape_value_async(
    base: str, name: str, token: str | None = None, default: float = _ABSENT, **labels: str
) -> float:
    """``(await scrape_async(base, token)).value(name, default, **labels)``: one awaitable
    to poll with ``until_async``, so a timeout reports the value last seen."""
    return (await scrape_async(base, token)).value(name, default, **labels)
