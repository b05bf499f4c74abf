"""The engine's side of the KV tiers: save sealed blocks, restore prefixes into reserved blocks.

A waiting request whose prefix continues below the device (host RAM, disk) gets device
blocks reserved for it and moves to `loading`; the loader fills them in the background
while the engine keeps stepping everyone else. When the copy lands the request returns to
the front of the queue holding its prefix, as if it had been computed.
"""
from __future__ import annotations

import logging
import os

from kvtier.config import Config
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.kv.keys import chain_keys
from kvtier.kv.pool import KVPool
from kvtier.kv.tiers.host import HostTier
from kvtier.kv.tiers.transfer import LoadJob, TierTransfer

log = logging.getLogger("kvtier.engine")

LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def build_tiers(config: Config, pool: KVPool) -> TierTransfer | None:
    host = HostTier(int(config.kv_host_gib * 2**30)) if config.kv_host_gib > 0 else None
    disk = None
    if config.kv_disk and config.kv_disk_gib > 0:
        from kvtier.kv.tiers.disk import DiskTier
        disk = DiskTier(os.path.expanduser(config.kv_disk_dir), int(config.kv_disk_gib * 2**30),
                        pool.namespace, pool.block_shape, pool.kv_cache.dtype)
    return TierTransfer(pool, host, disk) if host is not None or disk is not None else None


class Tiering:
    def __init__(self, transfer: TierTransfer, pool: KVPool, scheduler: Scheduler):
        self.transfer, self.pool, self.scheduler = transfer, pool, scheduler
        self.loading: dict[str, Sequence] = {}
        self.num_saving = 0                       # block runs pinned for a copy that has not landed
        self._looked_up: set[str] = set()
        self._warned = False
        self.load_counts = [0] * (len(LOAD_BUCKETS) + 1)   # per bucket, the last one is +Inf
        self.load_seconds_sum = 0.0

    def save(self, keys: list[bytes], blocks: list[int]) -> None:
        self.pool.pin(blocks)             # the slots stay ours until the copy lands
        self.num_saving += 1
        self.transfer.save(keys, blocks)

    @property
    def busy(self) -> bool:
        return bool(self.loading) or self.num_saving > 0

    def start_loads(self) -> None:
        """Look each new waiting request up below the device; reserve blocks and start its load."""
        for seq in list(self.scheduler.waiting):
            if seq.request_id in self._looked_up or seq.block_table:
                continue
            if seq.residency and not self.scheduler.pager.reserve_host(seq):
                continue     # a restore pins host blocks: wait for room in the host budget first
            self._looked_up.add(seq.request_id)
            exact = chain_keys(seq.token_ids[:-1], self.pool.block_size, self.pool.namespace, seq.root_key)
            if seq.residency and (self._start_manifest_load(seq, exact) or self._start_long_prefix_load(seq, exact)):
                continue
            limit = self.scheduler.pager.max_shared_blocks if self.scheduler.pager else None
            on_device, device_keys = self.pool.match_prefix(seq.token_ids, limit, seq.root_key)
            keys = exact[len(on_device):limit]
            on_host, on_disk = self.transfer.lookup(keys)
            count = on_host + on_disk
            # reserve blocks for the whole prompt, so that a restored request never waits for more
            # blocks while holding some (two such requests could otherwise starve each other)
            need = self.pool.blocks_for(len(seq)) - len(on_device)
            if limit is not None:     # bounded residency: never more than the budget
                need = min(self.pool.blocks_for(len(seq)), self.scheduler.pager.budget_blocks) - len(on_device)
            if count == 0 or not self.pool.can_allocate(need):
                self.pool.free(on_device)     # the scheduler matches the device part again at admission
                continue
            blocks = self.pool.allocate(need)
            seq.block_table = on_device + blocks
            seq.block_keys = device_keys
            seq.num_cached_tokens = len(on_device) * self.pool.block_size
            seq.tier_tokens = {"device": seq.num_cached_tokens, "host": on_host * self.pool.block_size,
                               "disk": on_disk * self.pool.block_size}
            self._begin_load(seq, LoadJob(seq.request_id, keys[:count], blocks[:count]))

    def _start_manifest_load(self, seq: Sequence, exact: list[bytes]) -> bool:
        """A bounded sequence continuing a saved one: reserve room for the resident blocks and load them.
        exact: the prompt's block keys in the exact namespace (a manifest is found by its prefix's)."""
        pager, manifests = self.scheduler.pager, self.transfer.manifests
        count, keys = len(exact), None
        while keys is None and count > pager.max_shared_blocks:     # the longest saved prefix
            keys = manifests.block_keys(pager.manifest_key(exact[count - 1]))
            count -= keys is None
        if keys is None or not all(self.transfer.holds(key) for key in keys):
            return False
        need = min(count, pager.budget_blocks)
        if not self.pool.can_allocate(need):
            return False
        on_host = sum(self.transfer.host.contains(key) for key in keys)
        seq.tier_tokens = {"host": on_host * self.pool.block_size, "disk": (count - on_host) * self.pool.block_size}
        seq.block_table = self.pool.allocate(need)     # until the load lands: freed by an abort or a miss
        self._begin_load(seq, LoadJob(seq.request_id, keys, seq.block_table, pager.manifest_key(exact[count - 1])))
        return True

    def _start_long_prefix_load(self, seq: Sequence, keys: list[bytes]) -> bool:
        """A bounded sequence whose exact prefix in the tiers is longer than its budget: restore it with the
        sink and tail blocks resident and the rest paged out, as if it had been prefilled here."""
        pager = self.scheduler.pager
        on_host, on_disk = self.transfer.lookup(keys)
        count = on_host + on_disk
        if count <= pager.max_shared_blocks:
            return False
        resident = [i < pager.sink_blocks or i >= count - pager.tail_blocks for i in range(count)]
        if not self.pool.can_allocate(sum(resident)):
            return False
        seq.tier_tokens = {"host": on_host * self.pool.block_size, "disk": on_disk * self.pool.block_size}
        seq.block_table = self.pool.allocate(sum(resident))
        self._begin_load(seq, LoadJob(seq.request_id, keys[:count], seq.block_table, resident=resident))
        return True

    def _begin_load(self, seq: Sequence, job: LoadJob) -> None:
        seq.status = SequenceStatus.LOADING
        self.scheduler.waiting.remove(seq)
        self.loading[seq.request_id] = seq
        self.transfer.load(job)

    def save_manifest(self, seq: Sequence) -> None:
        """A bounded sequence that went over its budget leaves its pager state beside its blocks."""
        pager = self.scheduler.pager
        if seq.block_keys and len(seq.block_table) > pager.budget_blocks:
            bs = self.pool.block_size
            exact = chain_keys(seq.token_ids[:len(seq.block_keys) * bs], bs, self.pool.namespace, seq.root_key)
            self.transfer.save_manifest(pager.manifest_key(exact[-1]), pager.manifest(seq))

    def poll(self) -> list[Sequence]:
        """Apply finished copies; returns loading requests that were aborted meanwhile."""
        events = self.transfer.poll()
        for blocks in events.saved:
            self.pool.free(blocks)
            self.num_saving -= 1
        aborted = []
        for job in events.loaded:
            self._observe_load(job.seconds)
            seq = self.loading.pop(job.request_id)
            self._looked_up.discard(seq.request_id)
            if seq.finish_reason == "abort":      # cancelled while loading: blocks are free only now
                self.pool.free(seq.block_table)
                seq.block_table = []
                aborted.append(seq)
                continue
            if job.ok and job.manifest is not None:
                self._take_manifest(seq, job)
            elif job.ok:
                for block, key in zip(job.blocks, job.keys):
                    self.pool.seal(block, key)
                seq.block_keys += job.keys
                seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_keys) * self.pool.block_size
            else:
                if not self._warned:
                    log.warning("a cached prefix could not be restored (damaged or evicted); recomputing it")
                    self._warned = True
                self.pool.free(seq.block_table)
                seq.block_table, seq.block_keys, seq.num_cached_tokens, seq.tier_tokens = [], [], 0, {}
                if job.manifest_key is None:
                    self._looked_up.add(seq.request_id)   # don't try the tiers again for this request
                # else the manifest is gone from the store: the next lookup restores the exact prefix only
            seq.status = SequenceStatus.WAITING
            self.scheduler.waiting.appendleft(seq)
        return aborted

    def _take_manifest(self, seq: Sequence, job: LoadJob) -> None:
        resident = [i for i, r in enumerate(job.manifest.resident) if r]
        placed = dict(zip(resident, job.blocks))
        for i, block in placed.items():
            self.pool.seal(block, job.keys[i])
        self.pool.free(job.blocks[len(resident):])      # reserved, not needed
        seq.block_keys = list(job.keys)
        self.scheduler.pager.restore(seq, job.manifest, placed)
        seq.num_computed_tokens = seq.num_cached_tokens = len(job.keys) * self.pool.block_size

    def _observe_load(self, seconds: float) -> None:
        self.load_counts[next((i for i, le in enumerate(LOAD_BUCKETS) if seconds <= le), len(LOAD_BUCKETS))] += 1
        self.load_seconds_sum += seconds

    def stats(self) -> dict:
        tiers = {}
        for tier in (self.transfer.host, self.transfer.disk):
            if tier is not None:
                tiers[tier.name] = {**tier.stats, "bytes_used": tier.bytes_used, "budget_bytes": tier.budget_bytes}
        if self.transfer.host is not None:
            tiers["host"]["pinned_bytes"] = self.transfer.host.pinned_bytes
        if self.transfer.disk is not None:
            tiers["disk"]["enabled"] = int(self.transfer.disk.enabled)
        return {"tiers": tiers, "load_buckets": LOAD_BUCKETS, "load_counts": list(self.load_counts),
                "load_seconds_sum": self.load_seconds_sum, "num_loading": len(self.loading)}

    def abort(self, request_id: str) -> bool:
        """Mark a loading request aborted; its blocks are freed once its copy has finished."""
        seq = self.loading.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        return True

    def forget(self, request_id: str) -> None:
        self._looked_up.discard(request_id)
