"""The measured speeds the KV manager weighs loading a cached prefix against computing it again.

A block from a tier is worth loading when the tier moves its bytes faster than the engine
computes them: its bandwidth (bytes/s, read plus copy to the device, from the loads so far)
beats the prefill rate (tokens/s, from the steps so far) times the bytes of one token. Both are
moving averages. Until both are measured the manager loads. A tier found slower is still tried
on every EXPLORE_EVERY-th prefix it would serve, so a measurement taken on a bad moment (a cold
page cache, a busy disk) does not rule it out for good.
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
        self.judged_slower: dict[str, int] = {}       # per tier: prefixes it would have served slower
        self.computed_instead: dict[str, int] = {}    # of those, computed (the others explored it again)

    def observe_tier(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.tier_bytes_per_s[tier] = _smoothed(self.tier_bytes_per_s.get(tier), nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = _smoothed(self.prefill_tokens_per_s, tokens / seconds)

    def worth_loading(self, tier: str) -> bool:
        bandwidth, rate = self.tier_bytes_per_s.get(tier), self.prefill_tokens_per_s
        if bandwidth is None or rate is None or bandwidth > rate * self.bytes_per_token:
            return True
        self.judged_slower[tier] = self.judged_slower.get(tier, 0) + 1
        if self.judged_slower[tier] % EXPLORE_EVERY == 0:
            return True
        self.computed_instead[tier] = self.computed_instead.get(tier, 0) + 1
        return False

    def stats(self) -> dict:
        return {"tier_bytes_per_s": dict(self.tier_bytes_per_s), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "computed_instead": dict(self.computed_instead)}


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
