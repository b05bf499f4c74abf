"""The measured speeds the KV manager weighs loading a cached prefix against computing it again.

Two moving averages: each tier's restore bandwidth (bytes/s, read plus copy to the device, from
the loads so far) and the prefill rate (tokens/s, from long prefill steps). For a prefix below
the device the manager computes its front while the back loads, split where both would finish
together (`blocks_to_compute`): all of it loads when a tier is much faster than computing, all of
it is computed when loading even its last block would take longer. Until both are measured the
manager loads. A prefix that would be computed whole still loads its last block on every
EXPLORE_EVERY-th time, so a measurement taken on a bad moment (a cold page cache, a busy disk)
does not rule a tier out for good.
"""
from __future__ import annotations

SMOOTHING = 0.3       # weight of the newest measurement
EXPLORE_EVERY = 16
# A restore replaces the prefill of a long prefix, which runs in long chunks: steps with fewer prompt tokens
# (the suffix after a restore, a short question) run at a lower rate and would make computing look slower.
MIN_PREFILL_TOKENS = 256


class Rates:
    def __init__(self, bytes_per_token: int):
        self.bytes_per_token = bytes_per_token
        self.tier_bytes_per_s: dict[str, float] = {}
        self.prefill_tokens_per_s: float | None = None
        self.computed_whole = 0                       # prefixes that would have been computed whole
        self.computed_instead: dict[str, int] = {}    # per tier: cached tokens computed rather than loaded

    def observe_tier(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.tier_bytes_per_s[tier] = _smoothed(self.tier_bytes_per_s.get(tier), nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = _smoothed(self.prefill_tokens_per_s, tokens / seconds)

    def blocks_to_compute(self, tiers: list[str], block_tokens: int) -> int:
        """How many leading blocks of a prefix below the device to compute while the others load (tiers: the
        tier holding each block, front first): the split where the later of the two finishes soonest."""
        rate, speeds = self.prefill_tokens_per_s, [self.tier_bytes_per_s.get(t) for t in tiers]
        if not tiers or rate is None or None in speeds:
            return 0
        block_bytes = self.bytes_per_token * block_tokens
        load_from = [0.0] * (len(tiers) + 1)      # load_from[m]: seconds to load blocks m and after
        for i in reversed(range(len(tiers))):
            load_from[i] = load_from[i + 1] + block_bytes / speeds[i]
        compute = block_tokens / rate             # seconds per block
        front = min(range(len(tiers) + 1), key=lambda m: (max(m * compute, load_from[m]), m))
        if front == len(tiers):
            self.computed_whole += 1
            front -= self.computed_whole % EXPLORE_EVERY == 0     # measure the tiers again with one block
        for tier in tiers[:front]:
            self.computed_instead[tier] = self.computed_instead.get(tier, 0) + block_tokens
        return front

    def stats(self) -> dict:
        return {"tier_bytes_per_s": dict(self.tier_bytes_per_s), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "computed_instead": dict(self.computed_instead)}


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
