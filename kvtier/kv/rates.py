"""The measured speeds the KV manager weighs loading a cached prefix against computing it again.

Two moving averages: each tier's restore bandwidth (bytes/s, read plus copy to the device, from
the loads so far; a new read buffer's one-time page faults left out) and the prefill rate
(tokens/s, from long prefill steps). For a prefix below the device the manager computes its front
while the back loads, split where both would finish together (`blocks_to_compute`): all of it
loads when a tier is much faster than computing, all of it is computed when loading even its last
block would take longer. Until both are measured the manager loads. A prefix that would be
computed whole still loads its last block on every EXPLORE_EVERY-th time, so a measurement taken
on a bad moment (a cold page cache, a busy disk) does not rule a tier out for good.

With a path (beside the disk tier) the rates are saved and taken up at the next start: a
restarted server would otherwise know neither rate until it had served, and so load every prefix
from disk, even where computing it is faster. They are written at shutdown and, while serving,
at most every SAVE_EVERY_S when they changed, so a server that is killed keeps them too. The file
is named by the model's namespace and the device it was measured on; a damaged or foreign file is
ignored.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time

import torch

from kvtier.averages import moving_average
from kvtier.kv.tiers.files import atomic_write, read_regular

log = logging.getLogger("kvtier.kv.rates")

SMOOTHING = 0.3       # weight of the newest measurement
EXPLORE_EVERY = 16
# A restore replaces the prefill of a long prefix, which runs in long chunks: steps with fewer prompt tokens
# (the suffix after a restore, a short question) run at a lower rate and would make computing look slower.
MIN_PREFILL_TOKENS = 256
MAX_FILE_BYTES = 1 << 12
SAVE_EVERY_S = 60.0


def rates_path(directory: str, namespace: bytes, device: torch.device) -> str:
    """Where the rates of this model (namespace) on this device are kept: a CPU's rates depend on its threads."""
    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
    else:
        label = f"{device.type}-{torch.get_num_threads()}-threads"
    return os.path.join(directory, f"{namespace.hex()[:16]}-{''.join(c if c.isalnum() else '_' for c in label)}.json")


class Rates:
    def __init__(self, bytes_per_token: int, path: str | None = None):
        self.bytes_per_token = bytes_per_token
        self.tier_bytes_per_s: dict[str, float] = {}
        self.prefill_tokens_per_s: float | None = None
        self.computed_whole = 0                       # prefixes that would have been computed whole
        self.computed_instead: dict[str, int] = {}    # per tier: cached tokens computed rather than loaded
        self.path = path
        self._written: dict | None = None     # the record last written or loaded
        self._looked_at = time.monotonic()     # when pending last compared the rates with it
        self.save_every_s = SAVE_EVERY_S
        if path is not None:
            self._load()

    def observe_tier(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.tier_bytes_per_s[tier] = moving_average(self.tier_bytes_per_s.get(tier), nbytes / seconds, SMOOTHING)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = moving_average(self.prefill_tokens_per_s, tokens / seconds, SMOOTHING)

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
            self.count_computed(tier, block_tokens)
        return front

    def count_computed(self, tier: str, tokens: int) -> None:
        """Cached tokens the tier holds that are computed rather than loaded."""
        self.computed_instead[tier] = self.computed_instead.get(tier, 0) + tokens

    def stats(self) -> dict:
        return {"tier_bytes_per_s": dict(self.tier_bytes_per_s), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "computed_instead": dict(self.computed_instead)}

    def pending(self, now: bool = False) -> dict | None:
        """The rates to write, if there is a path, something is measured and it differs from what was last written;
        unless now, they are looked at only every save_every_s (a call per engine step costs a clock read). Taking
        them counts as their write."""
        if self.path is None or (not now and time.monotonic() - self._looked_at < self.save_every_s):
            return None
        self._looked_at = time.monotonic()
        record = self._record()
        if record == self._written or (self.prefill_tokens_per_s is None and not self.tier_bytes_per_s):
            return None
        self._written = record
        return record

    def write(self, record: dict) -> None:
        """Write a record from `pending` to the path, atomically (on any thread: the record is a copy)."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            atomic_write(self.path, [json.dumps(record).encode()])
        except OSError as e:
            log.warning("the measured rates were not saved: %s", e)

    def _load(self) -> None:
        try:
            record = json.loads(read_regular(self.path, MAX_FILE_BYTES))
            prefill, tiers = record["prefill_tokens_per_s"], record["tier_bytes_per_s"]
            valid = (record["bytes_per_token"] == self.bytes_per_token and (prefill is None or _rate(prefill))
                     and isinstance(tiers, dict) and all(isinstance(t, str) and _rate(v) for t, v in tiers.items()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring the saved rates in %s: %s", self.path, e)
            return
        if not valid:
            log.warning("ignoring the saved rates in %s: not this model's, or not rates", self.path)
            return
        self.prefill_tokens_per_s, self.tier_bytes_per_s = prefill, dict(tiers)
        self._written = self._record()

    def _record(self) -> dict:
        return {"bytes_per_token": self.bytes_per_token, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "tier_bytes_per_s": dict(self.tier_bytes_per_s)}


def _rate(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

