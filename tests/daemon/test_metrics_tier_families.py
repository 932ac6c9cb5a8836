"""Each per-tier stats field is exported as its own family, with the tier as its label: gauges
under their names, the evictions as a counter (``_total``); a field a tier lacks is left out."""

from __future__ import annotations

from kvstore.daemon.metrics import DaemonMetrics

FIELDS = {
    "used_bytes": ("tierkv_tier_bytes", 11),
    "payload_bytes": ("tierkv_tier_payload_bytes", 12),
    "waste_bytes": ("tierkv_tier_waste_bytes", 13),
    "file_bytes": ("tierkv_tier_file_bytes", 14),
    "capacity_bytes": ("tierkv_tier_capacity_bytes", 15),
    "blocks": ("tierkv_tier_blocks", 16),
    "evictions": ("tierkv_tier_evictions_total", 17),
}


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_tier_field_is_its_own_family_labelled_by_tier():
    disk = {field: value for field, (_, value) in FIELDS.items()}
    dram = {k: v for k, v in disk.items() if k != "file_bytes"}
    text = DaemonMetrics(lambda: {"tiers": {"dram": dram, "disk": disk}, "node": {}}).render().decode()
    got = _samples(text)
    for field, (family, value) in FIELDS.items():
        assert got[f'{family}{{tier="disk"}}'] == value, field
        if field != "file_bytes":
            assert got[f'{family}{{tier="dram"}}'] == value, field
    assert 'tierkv_tier_file_bytes{tier="dram"}' not in got
    assert "# TYPE tierkv_tier_evictions_total counter" in text
    assert "# TYPE tierkv_tier_blocks gauge" in text
