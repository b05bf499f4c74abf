"""The tiers below the device, fastest first: host RAM, then local disk (a remote tier slots in after
it). A prefix is looked up as consecutive runs, one per tier; every tier's metrics come from here.
Beside them, the mover's two read buffers, carved from the host tier at start-up (staging.py)."""
from __future__ import annotations

from collections.abc import Callable

from kvtier.kv.tiers.base import Tier
from kvtier.kv.tiers.staging import Staging

# tiers below host and disk (a shared remote store, say), in this order: each a factory of (config, pool) that
# returns the tier, or None where the config leaves it out. A new tier is a file with its class and one entry here.
EXTRA_TIERS: list[Callable[[object, object], Tier | None]] = []


def extra_tiers(config, pool) -> list[Tier]:
    return [tier for factory in EXTRA_TIERS if (tier := factory(config, pool)) is not None]


class TierStack:
    def __init__(self, tiers: list[Tier], staging: Staging | None = None, gather: Staging | None = None):
        self.tiers = tiers
        self.host = self.find("host")
        self.disk = self.find("disk")
        self.staging = staging or Staging()     # restores from below the host tier read into it
        self.gather = gather or Staging()       # a bounded prompt chunk's paged-out blocks are gathered into it

    @property
    def pinnable_bytes(self) -> int:
        """What the host tier's slots for blocks hold: the most a bounded sequence's paged-out blocks may pin."""
        return self.host.block_budget_bytes if self.host is not None else 0

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def find(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def lookup(self, keys: list[bytes]) -> dict[str, int]:
        """Per tier, how many of the keys after the previous tiers' runs it holds in a row."""
        runs, start = {}, 0
        for tier in self.tiers:
            runs[tier.name] = tier.match_prefix(keys[start:])
            start += runs[tier.name]
        return runs

    def holds(self, key: bytes) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def holders(self, keys: list[bytes]) -> dict[str, int]:
        """Per tier, how many of the keys it is the fastest to hold (keys that none holds are left out)."""
        counts = dict.fromkeys((tier.name for tier in self.tiers), 0)
        for key in keys:
            tier = next((tier for tier in self.tiers if tier.contains(key)), None)
            if tier is not None:
                counts[tier.name] += 1
        return counts

    def stats(self) -> dict[str, dict]:
        return {tier.name: {**tier.stats, "bytes_used": tier.bytes_used, "budget_bytes": tier.budget_bytes,
                            "gauges": tier.extra_stats()} for tier in self.tiers}
