"""The one mover of KV bytes between the device pool and the tiers.

Three worker threads keep tier I/O off the engine loop:
- the saver copies sealed blocks out of the pool straight into the host tier's slab and writes
  each run through to the tiers below it as one unit (write-through: a run's blocks land in one
  disk file while they are together);
- the loader copies a restored prefix from the fastest tier holding each block into device
  blocks reserved for it, then promotes what came from below into the host tier;
- the pager carries bounded residency's page-outs (device → pinned in the host tier) and page-ins
  (host tier → device blocks reserved for them), a step's worth in one batch each, and the unpins
  of a finished sequence's host copies after the page-outs that made them.
On the engine's thread it only gathers a bounded prompt chunk's paged-out blocks from host memory
(`gather`), where each is pinned.

Every copy runs through the copier (copier.py): on CUDA on a stream of its own, after a mark taken
on the compute stream when the job was handed over, and the worker waits for it to land before
reporting; the engine frees or reuses a device block only once `poll` has said its copy landed
(invariant 1). Host memory on that path is pinned and allocated once: the host tier's slab and the
two read buffers carved from it (the stack's `staging` and `gather`). On CPU the same code runs
with plain memory and no streams. The pool is not thread-safe, so workers never touch its
bookkeeping: the engine pins blocks before handing them over and releases them when `poll`
reports the copy done.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvtier.kv.manifest import Manifest, ManifestStore
from kvtier.kv.pool import KVPool
from kvtier.kv.scorer import SUMMARIES, BlockSummaries
from kvtier.devices import on_device
from kvtier.kv.tiers.copier import copier_for
from kvtier.kv.tiers.stack import TierStack

SAVE_WAIT_S = 30          # the longest a load waits for the saves of its blocks

log = logging.getLogger("kvtier.kv.mover")


@dataclass
class LoadJob:
    request_id: str
    keys: list[bytes]                   # content keys of the prefix to restore, in order
    blocks: list[int]                   # device blocks reserved for it
    manifest_key: bytes | None = None   # a bounded sequence: only the manifest's resident blocks go to `blocks`
    resident: list[bool] | None = None  # a bounded sequence without a manifest: these blocks go to `blocks`
    manifest: Manifest | None = None    # read, or for `resident` made, by the loader
    partial_tokens: int = 0             # the last key is a partial block's (partials.py): its tokens used
    pinned: list[int] = field(default_factory=list)   # a bounded sequence's blocks left off the device: pinned in
                                                      # the host tier for it by the loader (by index in keys)
    tier_times: dict[str, tuple[int, float]] = field(default_factory=dict)   # tier → (bytes, seconds) it took
    ok: bool = False
    seconds: float = 0.0
    bytes: int = 0
    ready: object = None                # the compute stream's mark the copy runs after (copier.py)


@dataclass
class PageOut:
    owner: object                       # whose blocks these are, for the engine when it lands
    keys: list[bytes]
    blocks: list[int]                   # device blocks, held by the engine until the copy lands
    ok: bool = False                    # every payload is pinned in the host tier
    ready: object = None


@dataclass
class PageIn:
    owner: object                       # whose blocks these are, for the engine when it lands
    keys: list[bytes]
    blocks: list[int]                   # device blocks reserved for them
    ok: bool = False
    ready: object = None


@dataclass
class TransferEvents:
    saved: list[tuple[list[bytes], list[int]]] = field(default_factory=list)   # (keys, pinned blocks) of runs whose
                                                                                # copy-out landed
    loaded: list[LoadJob] = field(default_factory=list)
    paged_out: list[PageOut] = field(default_factory=list)
    paged_in: list[PageIn] = field(default_factory=list)


class Mover:
    def __init__(self, pool: KVPool, stack: TierStack, manifests: ManifestStore | None = None):
        self.pool, self.stack, self.manifests = pool, stack, manifests
        self.copier = copier_for(pool.device)
        self._saves: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._pages: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._landed = threading.Event()          # set whenever something is put on _done
        # keys whose save is queued or running: the next request's lookup counts them, and its load waits
        self._saving: Counter[bytes] = Counter()
        self._saving_changed = threading.Condition()
        self._gather_read = None     # the mark after the forward that last read the gather buffer
        device = pool.device
        self._threads = [threading.Thread(target=on_device(device, loop), name=name, daemon=True) for loop, name in
                         ((self._save_loop, "kvtier-saver"), (self._load_loop, "kvtier-loader"),
                          (self._page_loop, "kvtier-pager"))]
        for t in self._threads:
            t.start()

    # --- the engine's side -----------------------------------------------------------------------

    def fault_in_buffers(self) -> None:
        """Fault in now the read buffers (a restore from below the host tier, a bounded prompt's gather)."""
        self.stack.staging.fault_in()
        self.stack.gather.fault_in()

    def save(self, keys: list[bytes], blocks: list[int]) -> None:
        """Copy these sealed, pinned blocks out; `poll` reports when they may be unpinned."""
        with self._saving_changed:
            self._saving.update(keys)
        self._saves.put(("blocks", keys, blocks, self.copier.ready()))

    def saving_run(self, keys: list[bytes]) -> int:
        """How many of the keys, in a row from the first, are being saved: a tier holds them once it lands."""
        with self._saving_changed:
            return next((i for i, key in enumerate(keys) if not self._saving[key]), len(keys))

    def after_saves(self, write, *args) -> None:
        """Call write(*args) on the saver once the blocks queued before it are saved (a manifest, say). write is a
        store's own method, not a closure over its owner: a queued job keeps only what it writes alive."""
        self._saves.put(("call", functools.partial(write, *args), None, None))

    def load(self, job: LoadJob) -> None:
        job.ready = self.copier.ready()
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
            getattr(events, kind).append(item)

    def paging(self) -> bool:
        """Page copies or unpins are queued or running."""
        return self._pages.unfinished_tasks > 0

    def idle(self) -> bool:
        return all(q.unfinished_tasks == 0 for q in (self._saves, self._loads, self._pages))

    def shutdown(self) -> None:
        for q in (self._saves, self._loads, self._pages):
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)

    # --- paging --------------------------------------------------------------------------------

    def page_out(self, job: PageOut) -> None:
        """Pin the blocks' payloads in the host tier, copying those it does not hold yet; `poll` reports when
        the device blocks may go."""
        job.ready = self.copier.ready()
        self._pages.put(("paged_out", job))

    def page_in(self, job: PageIn) -> None:
        job.ready = self.copier.ready()
        self._pages.put(("paged_in", job))

    def unpin(self, keys: list[bytes]) -> None:
        """Unpin these host copies once the page-outs queued before have pinned them."""
        self._pages.put(("unpin", keys))

    def gather(self, runs: list[list[bytes]], in_flight: dict[bytes, int]) -> list[torch.Tensor | None]:
        """(The engine's thread.) Per run of a bounded prompt chunk's paged-out keys: their K/V [2, layers, tokens,
        kv_heads, head_dim] side by side, or None for an empty run, from the host tier's slots, where each is pinned
        (a page-out pins its blocks before it lands; a restore pins all it leaves off the device, or is a miss): no
        tier below the host is read here. A key whose page-out is in flight (`in_flight`: key → its device block,
        held until the copy lands) is copied from the device. Into the gather buffer, reused step after step, or
        fresh memory where it is too small."""
        self.copier.wait(self._gather_read)     # the last forward's copies out of it are done
        buffers = self.stack.gather.split([len(keys) * self.pool.block_bytes for keys in runs])
        return [self._gathered(keys, buffer, in_flight) if keys else None for keys, buffer in zip(runs, buffers)]

    def gather_read(self) -> None:
        """(The engine's thread, after a forward that read what `gather` gave.) Its buffer may be reused after this."""
        self._gather_read = self.copier.ready()

    def _gathered(self, keys: list[bytes], buffer: torch.Tensor | None, in_flight: dict[bytes, int]) -> torch.Tensor:
        host = self.stack.host
        landed = [key for key in keys if key not in in_flight]
        payloads = host.lease(landed) if landed else []
        if payloads is None:
            raise RuntimeError(f"a paged-out block of {len(landed)} is not in the host tier")
        try:
            two, layers, block, heads, dim = self.pool.block_shape
            shape, dtype = (two, layers, block * len(keys), heads, dim), self.pool.dtype
            out = torch.empty(shape, dtype=dtype) if buffer is None else buffer.view(dtype).view(shape)
            leased = iter(payloads)
            for j, key in enumerate(keys):
                parts = self.pool.block_kv(in_flight[key]) if key in in_flight else self.pool.payload_kv(next(leased))
                for half, part in zip(out[:, :, j * block:(j + 1) * block], parts):
                    half.copy_(part)
            return out
        finally:
            if landed:
                host.release(landed)

    # --- workers ---------------------------------------------------------------------------------

    def _save_loop(self) -> None:
        for item in iter(self._saves.get, None):
            self._save(*item)
            del item       # not kept while the queue is empty: a call may hold what its owner would free

    def _save(self, kind: str, keys, blocks: list[int] | None, ready) -> None:
        """A saves-queue job: a run of blocks to copy out and write below the device, or a call to make after the
        saves before it (keys is then the callable)."""
        if kind == "call":
            try:
                keys()
            except Exception:
                log.exception("a write after the saves failed")
            self._saves.task_done()
            return
        try:
            payloads, leased = self._copy_out_run(keys, blocks, ready)
        finally:
            self._done.put(("saved", (keys, blocks)))    # the device slots may be reused from here on
            self._landed.set()
        try:
            for tier in self.stack.tiers:
                if tier is not self.stack.host:
                    self._put_below(tier, keys, payloads)
        finally:
            if leased:
                self.stack.host.release(keys)
            self._saved(keys)
            self._saves.task_done()

    @staticmethod
    def _put_below(tier, keys: list[bytes], payloads: list[torch.Tensor]) -> None:
        """One tier's write: a tier that fails (a remote store's network, say) loses the run, not the saver."""
        try:
            tier.put_run(keys, payloads)
        except Exception:
            log.exception("the %s tier failed to save %d blocks", tier.name, len(keys))

    def _saved(self, keys: list[bytes]) -> None:
        with self._saving_changed:
            self._saving.subtract(keys)
            for key in keys:
                if self._saving[key] <= 0:
                    del self._saving[key]
            self._saving_changed.notify_all()

    def _wait_for_saves(self, keys: list[bytes]) -> None:
        """Until none of the keys is being saved (a request that found its prefix still in flight)."""
        with self._saving_changed:
            if not self._saving_changed.wait_for(lambda: not any(self._saving[key] for key in keys),
                                                 timeout=SAVE_WAIT_S):
                log.warning("saves of %d blocks took over %d s; loading what has landed", len(keys), SAVE_WAIT_S)

    def _copy_out_run(self, keys: list[bytes], blocks: list[int], ready) -> tuple[list[torch.Tensor], bool]:
        """Device → host memory: into the host tier's slab if there is one (its slots leased to the caller),
        else into a fresh CPU tensor. Returns the payloads and whether they are leased."""
        host = self.stack.host
        with self.copier.copying(ready, reads=blocks):
            if host is not None:
                host.put_run(keys, self.pool.blocks_out(blocks))
                leased = host.lease(keys)
                if leased is not None:
                    return leased, True
            return list(self.pool.read_blocks(blocks)), False

    def _page_loop(self) -> None:
        while (item := self._pages.get()) is not None:
            kind, job = item
            if kind == "unpin":
                try:
                    self.stack.host.release(job)
                except Exception:    # a count gone wrong: logged, the worker goes on
                    log.exception("unpinning %d host blocks failed", len(job))
                self._pages.task_done()
                continue
            try:
                job.ok = self._paged_out(job) if kind == "paged_out" else self._paged_in(job)
            except Exception:
                log.exception("a %s job of %d blocks failed", kind, len(job.keys))
                job.ok = False
            finally:
                self._done.put((kind, job))
                self._landed.set()
                self._pages.task_done()

    def _paged_out(self, job: PageOut) -> bool:
        """Pin the payloads in the host tier; those it does not hold (a save may have put them there) are
        copied in one batch. All or nothing: False (or an error) if it had no room, with nothing left pinned."""
        host, pinned, missing = self.stack.host, [], []
        try:
            for key, block in zip(job.keys, job.blocks):
                if host.pin(key):
                    pinned.append(key)
                else:
                    missing.append((key, block))
            if missing:
                with self.copier.copying(job.ready, reads=[block for _, block in missing]):
                    payloads = self.pool.blocks_out([block for _, block in missing])
                    for (key, _), payload in zip(missing, payloads):
                        if not host.put(key, payload, pin=True):
                            break
                        pinned.append(key)
        except BaseException:
            host.release(pinned)
            raise
        if len(pinned) < len(job.keys):
            host.release(pinned)
            return False
        return True

    def _paged_in(self, job: PageIn) -> bool:
        """Copy the payloads from the host tier, where a live sequence's paged-out blocks are pinned, into the
        reserved blocks in one batch. False if one is not there (its page-out failed)."""
        host = self.stack.host
        payloads = host.lease(job.keys)
        if payloads is None:
            return False
        try:
            with self.copier.copying(job.ready, writes=job.blocks):
                self.pool.blocks_in(job.blocks, payloads)
            return True
        finally:
            host.release(job.keys)

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            start, reads = time.perf_counter(), []
            try:
                job.ok = self._restore(job, reads)
            except Exception:   # damaged data must never take the engine down: count it as a miss
                log.exception("restoring %d blocks for %s failed; recomputing", len(job.keys), job.request_id)
                job.ok = False
            job.seconds = time.perf_counter() - start
            self._done.put(("loaded", job))
            self._landed.set()
            try:        # after the request has its blocks, off its time to first token
                if job.ok:
                    self._promote(reads)
            except Exception:
                log.exception("keeping %d restored blocks in the host tier failed", len(job.keys))
            finally:
                for tier, got, _ in reads:
                    tier.release(list(got))
                self._loads.task_done()

    def _restore(self, job: LoadJob, reads: list) -> bool:
        """Copy the job's resident blocks into the pool; False on a miss. Without a manifest, a bounded
        sequence's blocks are all read once, to summarize their keys. The reads it made are appended to
        `reads`, for the caller to promote (once the job has landed) and release."""
        self._wait_for_saves(job.keys)
        resident = [True] * len(job.keys) if job.resident is None else job.resident
        if job.manifest_key is not None:
            job.manifest = self.manifests.get(job.manifest_key)
            if job.manifest is None or job.manifest.keys != job.keys:
                self.manifests.discard(job.manifest_key)     # the retry takes the exact prefix only
                return False
            resident = job.manifest.resident
        wanted = [key for key, r in zip(job.keys, resident) if r]
        if len(wanted) > len(job.blocks):
            return False
        keys = job.keys if job.resident is not None else wanted
        got_reads = self._read(keys)
        if got_reads is None:
            return False
        reads += got_reads
        payloads = {key: payload for tier, got, _ in reads for key, payload in got.items()}
        start = time.perf_counter()
        with self.copier.copying(job.ready, writes=job.blocks[:len(wanted)]):
            self.pool.blocks_in(job.blocks[:len(wanted)], [payloads[key] for key in wanted])
        copy_s = (time.perf_counter() - start) / max(1, len(wanted))
        job.bytes = len(wanted) * self.pool.block_bytes
        for tier, got, read_s in reads:      # the copy's time shared out by blocks
            job.tier_times[tier.name] = (len(got) * self.pool.block_bytes, read_s + copy_s * len(got))
        if job.resident is not None:
            job.manifest = self._summarized(job.keys, job.resident, payloads)
        if job.manifest is not None:
            pinned = self._pin_offloaded(job.keys, job.manifest.resident, payloads)
            if pinned is None:
                return False
            job.pinned = pinned
        return True

    def _pin_offloaded(self, keys: list[bytes], resident: list[bool], payloads: dict) -> list[int] | None:
        """Pin a restored bounded sequence's blocks left off the device in the host tier, reading those it lacks
        from below: its next prompt chunk attends to them all, and the engine thread reads them from host memory
        only (pager.py). Returns their indices; all or none: None, with nothing pinned, if one found no room or is
        in no tier (the restore is then a miss)."""
        host, pinned, below = self.stack.host, [], []
        for i, key in enumerate(keys):
            if resident[i]:
                continue
            if key in payloads:                 # read for the summaries, in hand
                if host.put(key, payloads[key], pin=True):
                    pinned.append(i)
            elif host.pin(key):
                pinned.append(i)
            else:
                below.append(i)
        reads = self._read([keys[i] for i in below], fresh=True) if below else []   # the staging buffer holds
        try:                                                                          # `payloads` until promoted
            got = {key: payload for _, run, _ in reads or [] for key, payload in run.items()}
            pinned += [i for i in below if keys[i] in got and host.put(keys[i], got[keys[i]], pin=True)]
        finally:
            for tier, run, _ in reads or []:
                tier.release(list(run))
        if len(pinned) < resident.count(False):
            host.release([keys[i] for i in pinned])
            return None
        return sorted(pinned)

    def _read(self, keys: list[bytes], fresh: bool = False) -> list[tuple[object, dict, float]] | None:
        """Each key's payload from the fastest tier holding it: [(tier, {key: payload}, seconds)], every read
        to be released; None (everything released) if some key is in no tier. Reads from disk land in the
        staging buffer (valid until its next use), or with `fresh` in new buffers."""
        reads, missing = [], list(keys)
        staging = None if fresh else self.stack.staging
        for tier in self.stack.tiers:
            here = [key for key in missing if tier.contains(key)]
            start = time.perf_counter()
            got = tier.read_run(here, staging) if here else None
            if got is not None:
                reads.append((tier, dict(zip(here, got)), time.perf_counter() - start))
                if tier is not self.stack.host:
                    staging = None      # one lower tier reads into it; a second would overwrite what the first gave
                missing = [key for key in missing if key not in reads[-1][1]]
        if missing:
            for tier, got, _ in reads:
                tier.release(list(got))
            return None
        return reads

    def _promote(self, reads: list[tuple[object, dict]]) -> None:
        """The next turn finds what came from below the host tier one tier up."""
        host = self.stack.host
        if host is not None:
            for tier, got, _ in reads:
                if tier is not host:
                    host.put_run(list(got), list(got.values()))

    def _summarized(self, keys: list[bytes], resident: list[bool], payloads: dict) -> Manifest:
        """The pager state of a bounded sequence restored without a manifest: key summaries, nothing else."""
        summaries = BlockSummaries()
        for key in keys:
            summaries.add(payloads[key][0])
        device = self.pool.device
        tensors = {name: getattr(summaries, name).to(device) for name in SUMMARIES}
        tensors["scores"] = torch.zeros(len(keys))
        return Manifest(keys, resident, list(range(len(keys))), 0, [], tensors)
