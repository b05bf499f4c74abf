"""Background copies between the device pool and the lower tiers.

Two worker threads keep tier I/O off the engine loop:
- the saver copies sealed blocks out of the pool into the host tier and writes each run
  through to disk as one file (write-through: a run's blocks land in one file while they
  are together; writing back on host eviction would scatter them into one file per block);
- the loader copies a restored prefix from host / disk into device blocks reserved for it
  (for a bounded sequence with a manifest: only the blocks that were resident).
The pool is not thread-safe, so workers never touch its bookkeeping: the engine pins
blocks before handing them over and releases them when `poll` reports the copy done.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from kvtier.kv.manifest import Manifest, ManifestStore
from kvtier.kv.pool import KVPool
from kvtier.kv.scorer import SUMMARIES, BlockSummaries
from kvtier.kv.tiers.disk import Staging

STAGING_MAX_BYTES = 1 << 30

log = logging.getLogger("kvtier.kv.transfer")


@dataclass
class LoadJob:
    request_id: str
    keys: list[bytes]                   # content keys of the prefix to restore, in order
    blocks: list[int]                   # device blocks reserved for it
    manifest_key: bytes | None = None   # a bounded sequence: only the manifest's resident blocks go to `blocks`
    resident: list[bool] | None = None  # a bounded sequence without a manifest: these blocks go to `blocks`
    manifest: Manifest | None = None    # read, or for `resident` made, by the loader
    ok: bool = False
    seconds: float = 0.0
    bytes: int = 0


@dataclass
class TransferEvents:
    saved: list[list[int]] = field(default_factory=list)   # pinned block runs whose copy-out landed
    loaded: list[LoadJob] = field(default_factory=list)


class TierTransfer:
    def __init__(self, pool: KVPool, host=None, disk=None):
        self.pool, self.host, self.disk = pool, host, disk
        self.manifests: ManifestStore | None = None     # set when the engine runs bounded residency
        self._saves: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._landed = threading.Event()          # set whenever something is put on _done
        self._staging = Staging(STAGING_MAX_BYTES)
        self.load_seconds: list[float] = []       # drained by the metrics collector
        self._threads = [threading.Thread(target=self._save_loop, name="kvtier-saver", daemon=True),
                         threading.Thread(target=self._load_loop, name="kvtier-loader", daemon=True)]
        for t in self._threads:
            t.start()

    def lookup(self, keys: list[bytes]) -> tuple[int, int]:
        """How many leading keys the host tier holds, then how many of the rest the disk holds."""
        on_host = self.host.match_prefix(keys) if self.host else 0
        on_disk = 0
        if self.disk is not None:   # DiskTier locks only its in-memory index: no I/O on this path
            on_disk = self.disk.match_prefix(keys[on_host:])
        return on_host, on_disk

    def holds(self, key: bytes) -> bool:
        return any(tier is not None and tier.contains(key) for tier in (self.host, self.disk))

    def save(self, keys: list[bytes], blocks: list[int]) -> None:
        """Copy these sealed, pinned blocks out; `poll` reports when they may be unpinned."""
        self._saves.put(("blocks", keys, blocks))

    def save_manifest(self, key: bytes, manifest: Manifest) -> None:
        """Store a manifest after the blocks queued before it."""
        self._saves.put(("manifest", key, manifest))

    def load(self, job: LoadJob) -> None:
        self._loads.put(job)

    def wait(self, timeout: float) -> None:
        """Sleep until a copy lands (or timeout): for an engine with nothing to do but wait for one."""
        self._landed.wait(timeout)
        self._landed.clear()

    def poll(self) -> TransferEvents:
        events = TransferEvents()
        while True:
            try:
                kind, item = self._done.get_nowait()
            except queue.Empty:
                return events
            (events.saved if kind == "saved" else events.loaded).append(item)

    def idle(self) -> bool:
        return self._saves.unfinished_tasks == 0 and self._loads.unfinished_tasks == 0

    def shutdown(self) -> None:
        for q in (self._saves, self._loads):
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)

    def _save_loop(self) -> None:
        while (item := self._saves.get()) is not None:
            kind, keys, blocks = item
            if kind == "manifest":
                self.manifests.put(keys, blocks)
                self._saves.task_done()
                continue
            try:
                payloads = [self.pool.read_block(b) for b in blocks]
            finally:
                self._done.put(("saved", blocks))    # the device slots may be reused from here on
                self._landed.set()
            if self.host is not None:
                for key, payload in zip(keys, payloads):
                    self.host.put(key, payload)
            if self.disk is not None:
                self.disk.put_run(keys, payloads)
            self._saves.task_done()

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            start = time.perf_counter()
            from_disk = []
            try:
                from_disk = self._restore(job)
                job.ok = from_disk is not None
            except Exception:   # damaged data must never take the engine down: count it as a miss
                log.exception("restoring %d blocks for %s failed; recomputing", len(job.keys), job.request_id)
                job.ok = False
            job.seconds = time.perf_counter() - start
            self._done.put(("loaded", job))
            self._landed.set()
            if job.ok and self.host is not None:
                # promote after the request has its blocks: the next turn finds them one tier up
                for key, payload in from_disk:
                    self.host.put(key, payload.clone())   # off the staging buffer, which the next load reuses
            self._loads.task_done()

    def _restore(self, job: LoadJob) -> list | None:
        """Copy the job's resident blocks into the pool; returns the (key, payload)s read from disk, None on a
        miss. Without a manifest, a bounded sequence's blocks are all read once, to summarize their keys."""
        resident = [True] * len(job.keys) if job.resident is None else job.resident
        if job.manifest_key is not None:
            job.manifest = self.manifests.get(job.manifest_key)
            if job.manifest is None or job.manifest.keys != job.keys:
                self.manifests.discard(job.manifest_key)     # the retry takes the exact prefix only
                return None
            resident = job.manifest.resident
        wanted = [key for key, r in zip(job.keys, resident) if r]
        if len(wanted) > len(job.blocks):
            return None
        fetched = self._fetch(job.keys if job.resident is not None else wanted)
        if fetched is None:
            return None
        payloads, from_disk = fetched
        for block, key in zip(job.blocks, wanted):
            self.pool.write_block(block, payloads[key])
        job.bytes = len(wanted) * self.pool.block_bytes
        if job.resident is not None:
            job.manifest = self._summarized(job.keys, job.resident, payloads)
        return from_disk

    def _summarized(self, keys: list[bytes], resident: list[bool], payloads: dict) -> Manifest:
        """The pager state of a bounded sequence restored without a manifest: key summaries, nothing else."""
        summaries = BlockSummaries()
        for key in keys:
            summaries.add(payloads[key][0])
        device = self.pool.kv_cache.device
        tensors = {name: getattr(summaries, name).to(device) for name in SUMMARIES}
        tensors["scores"] = torch.zeros(len(keys))
        return Manifest(keys, resident, list(range(len(keys))), 0, [], tensors)

    def _fetch(self, keys: list[bytes]) -> tuple[dict, list] | None:
        """Payloads by key from the host tier, else the disk tier; and the (key, payload)s read from disk."""
        payloads = {}
        for key in keys:
            payload = self.host.get(key) if self.host is not None else None
            if payload is not None:
                payloads[key] = payload
        missing = [key for key in keys if key not in payloads]
        if not missing:
            return payloads, []
        got = self.disk.get_run(missing, self._staging) if self.disk is not None else None
        if got is None:
            return None
        payloads.update(zip(missing, got))
        return payloads, list(zip(missing, got))
