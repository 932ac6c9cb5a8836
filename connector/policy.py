"""Load or recompute: a cost model from measured tier bandwidth and measured prefill speed.

Loading ``k`` leading blocks costs ``latency(tier) + bytes / bandwidth(tier)`` summed over the
tiers they sit in; recomputing them costs ``k * block_tokens / prefill_tokens_per_s``. The
model picks the ``k`` (0..hit) that saves the most time, so a hit is never slower than
computing. Estimates start from configured priors and follow measurements (an exponentially
weighted moving average), so a slow node or a fast GPU shifts the decision by itself.
Not thread-safe; owned by one connector on one event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

# Priors (bytes/s, seconds) until a tier has been measured.
_PRIOR_BW = {"dram": 4e9, "hbm": 20e9, "disk": 1e9, "remote": 1e9}
_PRIOR_LAT = {"dram": 50e-6, "hbm": 20e-6, "disk": 300e-6, "remote": 500e-6}


def _family(tier: str) -> str:
    return "remote" if tier.startswith("remote") else tier


@dataclass
class Decision:
    load_blocks: int  # leading blocks worth loading
    hit_blocks: int
    load_s: float  # estimated time to load them
    recompute_s: float  # estimated time to compute them instead


class CostModel:
    def __init__(self, prefill_tokens_per_s: float, alpha: float = 0.3) -> None:
        self.prefill_tps = prefill_tokens_per_s
        self.alpha = alpha
        self.bandwidth: dict[str, float] = {}
        self.latency: dict[str, float] = {}
        self.prefill_measured = False

    def bw(self, tier: str) -> float:
        return self.bandwidth.get(tier, _PRIOR_BW.get(_family(tier), 1e9))

    def lat(self, tier: str) -> float:
        return self.latency.get(tier, _PRIOR_LAT.get(_family(tier), 1e-3))

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` from ``tier`` took ``seconds`` (whole batch, end to end)."""
        if nbytes <= 0 or seconds <= 0:
            return
        bw = nbytes / seconds
        self.bandwidth[tier] = bw if tier not in self.bandwidth else self._ewma(self.bandwidth[tier], bw)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        tps = tokens / seconds
        self.prefill_tps = tps if not self.prefill_measured else self._ewma(self.prefill_tps, tps)
        self.prefill_measured = True

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def decide(self, tiers: list[str], block_bytes: int, block_tokens: int) -> Decision:
        """``tiers[i]``: where hit block ``i`` sits. Returns how many leading blocks to load."""
        best_k, best_gain, load_s = 0, 0.0, 0.0
        best_load = 0.0
        seen: set[str] = set()
        for k, tier in enumerate(tiers, start=1):
            if tier not in seen:  # one round trip per tier touched
                seen.add(tier)
                load_s += self.lat(tier)
            load_s += block_bytes / self.bw(tier)
            gain = k * block_tokens / self.prefill_tps - load_s
            if gain > best_gain:
                best_k, best_gain, best_load = k, gain, load_s
        recompute = best_k * block_tokens / self.prefill_tps
        return Decision(best_k, len(tiers), best_load, recompute)
