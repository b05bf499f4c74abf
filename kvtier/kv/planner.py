"""The load planner: what a waiting request restores from the tiers below the device, and from which.

It reads the pool, the tier stack, the measured rates (rates.py), the partial blocks and the
manifests, and answers with a LoadPlan that fits the pool as it is now, or None. The KV manager
reserves the plan's blocks, writes the request's state and hands the copy to the mover: the
planner writes nothing but the rates' counters.

- `prefix`: the exact prefix after what the device holds, split by the rates into a front to
  compute and a back to load, and a partial block continuing it;
- `bounded`: a bounded sequence continuing a saved one (its manifest's resident blocks), or one
  whose exact prefix in the tiers is longer than its residency budget (sink and tail resident).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.kv.manifest import ManifestStore
from kvtier.kv.pager import Pager
from kvtier.kv.partials import PartialBlocks
from kvtier.kv.pool import KVPool
from kvtier.kv.rates import Rates
from kvtier.kv.state import KVState
from kvtier.kv.tiers.stack import TierStack

log = logging.getLogger("kvtier.kv.planner")


@dataclass
class LoadPlan:
    keys: list[bytes]                   # what the loader copies, in block order
    num_blocks: int                     # device blocks to reserve beside those the device holds already
    tier_tokens: dict[str, int]         # the prompt tokens each tier (the device too) will have given
    front: int = 0                      # blocks computed from the front while the rest loads; the load goes to
                                        # the reserved blocks from here on
    partial_tokens: int = 0             # the last key is a partial block's: its tokens used
    manifest_key: bytes | None = None   # a saved bounded sequence: its resident blocks load
    resident: list[bool] | None = None  # a bounded sequence without a manifest: these blocks load


class LoadPlanner:
    def __init__(self, pool: KVPool, stack: TierStack, rates: Rates, partials: PartialBlocks,
                 pager: Pager | None = None, manifests: ManifestStore | None = None,
                 saving_run: Callable[[list[bytes]], int] = lambda keys: 0):
        self.pool, self.stack, self.rates, self.partials = pool, stack, rates, partials
        self.saving_run = saving_run     # how many keys in a row are being saved (the mover's): soon in a tier
        self.pager, self.manifests = pager, manifests
        self.block_size = pool.block_size

    @property
    def shared_limit(self) -> int | None:
        """Blocks a new sequence may take from caches: a bounded one's first chunk must still fit its budget."""
        return self.pager.max_shared_blocks if self.pager else None

    def prefix(self, state: KVState, exact: list[bytes], on_device: int) -> tuple[LoadPlan | None, int]:
        """The prompt's exact prefix after the `on_device` blocks the pool holds (None when nothing is worth
        loading or the pool cannot reserve the blocks), and the prompt tokens the cache holds (`held_tokens`),
        whatever of them is loaded."""
        bs, limit = self.block_size, self.shared_limit
        keys = exact[on_device:limit]
        tiers = [tier for tier, n in self.stack.lookup(keys).items() for _ in range(n)]     # each block's tier
        # blocks still being saved after those: the first tier's once the save lands, which the load waits for
        tiers += [self.stack.tiers[0].name] * self.saving_run(keys[len(tiers):])
        count, front = len(tiers), self.rates.blocks_to_compute(tiers, bs)
        if limit is not None and front:      # a bounded sequence's restore is all or nothing
            front = count
        held_keys = exact[:on_device] + keys[:count]
        hit, partial = self.partial_after(state, held_keys), None
        if limit is None:
            partial = self._partial_in_tiers(hit, on_device_too=front == count)
            if partial is not None and 0 < front == count:    # computed with the whole prefix before it
                self.rates.count_computed(partial[0], partial[2])
                partial = None
        held = self.held_tokens(held_keys, hit)
        if front == count and partial is None:
            return None, held
        # blocks for the whole prompt, so that a restored request never waits for more while holding some
        # (two such requests could otherwise starve each other); under bounded residency, the budget's worth
        need = self.pool.blocks_for(len(state.token_ids))
        if limit is not None:
            need = min(need, self.pager.budget_blocks)
        if not self.pool.can_allocate(need - on_device):
            return None, held
        if front:
            log.info("computing %d cached tokens while the next %d load (%s)", front * bs, (count - front) * bs,
                     self.rates.stats())
        plan = LoadPlan(keys[front:count], need - on_device,
                        {"device": on_device * bs, **{name: n * bs for name, n in Counter(tiers[front:]).items()}},
                        front)
        if partial is not None:
            tier, key, plan.partial_tokens = partial
            plan.keys.append(key)
            plan.tier_tokens[tier] = plan.tier_tokens.get(tier, 0) + plan.partial_tokens
        return plan, held

    def bounded(self, exact: list[bytes]) -> LoadPlan | None:
        """A bounded sequence's restore over its budget, from a manifest or else from the exact prefix."""
        return self._from_manifest(exact) or self._long_prefix(exact)

    def partial_after(self, state: KVState, keys: list[bytes]) -> tuple[bytes, int] | None:
        """The partial block after these leading full blocks, for the prompt tokens it shares (never the last)."""
        parent = keys[-1] if keys else state.root_key
        start = len(keys) * self.block_size
        return self.partials.match(parent, state.token_ids[start:len(state.token_ids) - 1])

    def held_tokens(self, keys: list[bytes], hit: tuple[bytes, int] | None) -> int:
        """The prompt tokens these leading full blocks hold, and the partial block continuing them (hit:
        `partial_after`'s) wherever it lies (the device, a save in flight, a tier), whether it is loaded or computed
        again: what makes a prompt short for ggml's decode steps (engine/runner.py)."""
        held = hit is not None and (hit[0] in self.pool.cached or self.saving_run([hit[0]]) > 0 or
                                    self._tier_of(hit[0]) is not None)
        return len(keys) * self.block_size + (hit[1] if held else 0)

    def _tier_of(self, key: bytes):
        """The first tier that holds the key, or None."""
        return next((tier for tier in self.stack.tiers if tier.contains(key)), None) if self.stack else None

    def _partial_in_tiers(self, hit: tuple[bytes, int] | None, on_device_too: bool) -> tuple[str, bytes, int] | None:
        """The partial block continuing the prompt's full blocks (hit: `partial_after`'s) where a tier holds it:
        (the tier's name, its key, its tokens to use). None where on_device_too and the device has it: admission
        copies it there, without a load."""
        if hit is None or (on_device_too and hit[0] in self.pool.cached):
            return None
        tier = self._tier_of(hit[0])
        return None if tier is None else (tier.name, *hit)

    def _from_manifest(self, exact: list[bytes]) -> LoadPlan | None:
        """A bounded sequence continuing a saved one: its manifest's resident blocks load.
        exact: the prompt's block keys in the exact namespace (a manifest is found by its prefix's)."""
        pager = self.pager
        count, keys = len(exact), None
        while keys is None and count > pager.max_shared_blocks:     # the longest saved prefix
            keys = self.manifests.block_keys(pager.manifest_key(exact[count - 1]))
            count -= keys is None
        if keys is None:
            return None
        # a manifest is kept as its sequence finishes: blocks it names may still be saving (a next turn that comes at
        # once), which land in the first tier, and which the load waits for (asked first: a save that lands between
        # the two questions is held by then)
        saving = {key for key in keys if self.saving_run([key])}
        rest = [key for key in keys if key not in saving]
        if not all(self.stack.holds(key) for key in rest):
            return None
        need = min(count, pager.budget_blocks)
        if not self.pool.can_allocate(need):
            return None
        held = self.stack.holders(rest)
        held[self.stack.tiers[0].name] += len(saving)
        tiers = {name: n * self.block_size for name, n in held.items()}
        return LoadPlan(keys, need, tiers, manifest_key=pager.manifest_key(exact[count - 1]))

    def _long_prefix(self, keys: list[bytes]) -> LoadPlan | None:
        """An exact prefix in the tiers longer than the budget: restored with the sink and tail blocks resident
        and the rest paged out, as if it had been prefilled here."""
        pager = self.pager
        runs = self.stack.lookup(keys)
        count = sum(runs.values())
        if count <= pager.max_shared_blocks:
            return None
        resident = [i < pager.sink_blocks or i >= count - pager.tail_blocks for i in range(count)]
        if not self.pool.can_allocate(sum(resident)):
            return None
        return LoadPlan(keys[:count], sum(resident), {name: n * self.block_size for name, n in runs.items()},
                        resident=resident)
