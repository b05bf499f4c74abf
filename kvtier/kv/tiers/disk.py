"""Disk tier: runs of KV blocks in files under one directory, LRU-evicted to a byte budget.

Each put_run writes one block file (see blockfile.py) named after its first key and sharded
by that key's first two hex digits: DIR/ab/ab12....kvb. The index (key → file, block) is in
memory and is rebuilt at start-up from the files' headers alone. A file is the unit of
eviction; files are ordered by last read or write, at start-up by mtime (reads touch it).

Nothing here raises on bad data or a bad disk. A damaged file is a miss and is deleted, at
start-up too. Room is made before a file is written; a full disk (ENOSPC, EDQUOT) or an I/O
error makes more room and tries once more. A directory that cannot be used turns the tier
off with one warning, and it tries again by itself after a back-off (doubling up to
MAX_BACKOFF_S). Only regular files are read: links, FIFOs and other entries are skipped one
by one. Temp files are locked by their writer; start-up removes only those no process holds.
Files of another namespace, block shape, dtype or format version are left alone: not
indexed, not counted against the budget, never evicted. Thread-safe; file I/O runs outside
the lock.

Several processes may share one directory (two servers, a restart beside a running one):
- a writer holds DIR/.lock (flock) while it makes room and writes, and first brings its index
  up to date with the directory (peers' new files become hits for it, files they evicted
  leave it), so the budget holds for all of them together and eviction is LRU across them
  (a read touches its file's mtime);
- a reader holds a shared flock on the file it reads, and an evictor skips a file it cannot
  lock exclusively: no process deletes a file another is reading;
- a file that vanished or was replaced under a reader is a plain miss, not damage.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvtier.kv.keys import KEY_BYTES
from kvtier.kv.tiers.blockfile import (
    BlockFileError,
    Header,
    UnknownVersion,
    dtype_name,
    file_size,
    read_blocks,
    read_header,
    read_span,
    write_block_file,
)

from kvtier.kv.tiers.files import TMP_SUFFIX, is_stale_temp, regular_files, remove
from kvtier.kv.tiers.staging import Staging

log = logging.getLogger("kvtier.kv.disk")

SUFFIX = ".kvb"
LOCK_NAME = ".lock"
# what else kvtier keeps under the directory, which the budget covers too: subdirectory → file suffix (manifests,
# kv/manifest.py; partial blocks, kv/partials.py; what loading and computing cost, kv/rates.py; the Responses API's
# kept conversations, server/responses.py), and the weights' digests (models/digest.py)
SIDE_STORES = {"manifests": ".kvm", "draft-manifests": ".kvm", "partials": ".kvp", "rates": ".json", "responses": ".json"}
FINGERPRINTS = "fingerprints.json"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EIO)   # worth making room and trying once more
FIRST_BACKOFF_S = 5.0
MAX_BACKOFF_S = 300.0


@dataclass(eq=False)
class BlockFile:
    path: str
    size: int
    header: Header
    inode: int = 0
    mtime_ns: int = 0     # last write or read: its mtime, or our own finer clock when we touched it last


class DiskTier:
    name = "disk"

    def __init__(self, directory: str, budget_bytes: int, namespace: bytes,
                 block_shape: tuple[int, ...], dtype: torch.dtype):
        if len(namespace) != KEY_BYTES:
            raise ValueError(f"disk tier namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
        self.directory = directory
        self.budget_bytes = budget_bytes
        self.namespace = namespace
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = math.prod(self.block_shape) * dtype.itemsize
        self.bytes_used = 0
        self.disabled_until: float | None = None    # monotonic time of the next try while disabled
        self.backoff_s = FIRST_BACKOFF_S
        self.loaded = False                          # the index was built from the directory
        self.files: OrderedDict[str, BlockFile] = OrderedDict()   # path → file, least recently used first
        self.index: dict[bytes, tuple[BlockFile, int]] = {}       # key → (file, block in file)
        self.stats = dict.fromkeys(("lookups", "hit_blocks", "bytes_read", "bytes_written", "evictions", "errors",
                                    "retries", "damaged_removed"), 0)
        self._lock = threading.Lock()
        self._lock_fd: int | None = None    # DIR/.lock, held by put_run while it evicts and writes
        self._side: dict[str, tuple[int, int]] = {}     # side store → (its directory's mtime, bytes) when summed
        if self._open():
            self._evict(self.budget_bytes - self._side_bytes())

    @property
    def enabled(self) -> bool:
        with self._lock:
            return self._usable()

    def extra_stats(self) -> dict:
        return {"enabled": int(self.enabled)}

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._usable() and key in self.index

    def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are on disk."""
        with self._lock:
            n = 0
            while self._usable() and n < len(keys) and keys[n] in self.index:
                n += 1
            self.stats["lookups"] += 1
            return n

    def put_run(self, keys: list[bytes], payloads: list[torch.Tensor], token_counts: list[int] | None = None) -> None:
        """Write the blocks not stored yet as one file, then evict LRU files down to the budget."""
        if token_counts is None:
            token_counts = [0] * len(keys)
        if not len(keys) == len(payloads) == len(token_counts):
            raise ValueError(f"put_run got {len(keys)} keys, {len(payloads)} payloads, "
                             f"{len(token_counts)} token counts")
        with self._lock:
            usable = self._usable()
            reopen = not usable and self._reopen_due()
        if reopen:
            usable = self._open()
            if usable:
                log.warning("disk tier enabled again: %s", self.directory)
        if usable:
            with self._directory_locked():
                self._put_run(keys, payloads, token_counts)

    def _put_run(self, keys: list[bytes], payloads: list[torch.Tensor], token_counts: list[int]) -> None:
        """(Under the directory lock.)"""
        self._sync()          # what peers wrote or evicted since
        with self._lock:
            new = [i for i, key in enumerate(keys) if key not in self.index]
        if not new:
            return
        size = file_size(len(new), len(self.block_shape), self.block_bytes)
        budget = self.budget_bytes - self._side_bytes()     # what the block files may use
        if size > budget:   # could never fit
            return
        keys = [keys[i] for i in new]
        path = os.path.join(self.directory, keys[0].hex()[:2], keys[0].hex() + SUFFIX)
        for attempt in range(2):
            self._evict(budget - size)    # room first: a budget near the free space must fit
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                header = write_block_file(path, self.namespace, self.block_shape, self.dtype, keys,
                                          [payloads[i] for i in new], [token_counts[i] for i in new])
                break
            except OSError as e:
                if attempt == 0 and e.errno in DISK_FULL and self._make_room(size):
                    continue      # the disk filled up under us: our least recently used files made room
                if isinstance(e, FileNotFoundError):
                    return        # a peer starting up took the temp file for a leftover: this run is not saved
                self._disable(f"cannot write {path}: {e}")
                return
        written = os.stat(path)
        with self._lock:
            self._add(BlockFile(path, size, header, written.st_ino, time.time_ns()))
            self.stats["bytes_written"] += size
        self._evict(budget)

    @contextlib.contextmanager
    def _directory_locked(self):
        """Hold DIR/.lock: one process at a time makes room and writes. Without a lock file (a read-only
        directory, say) the writes that follow fail and disable the tier as before."""
        try:
            if self._lock_fd is None:
                self._lock_fd = os.open(os.path.join(self.directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def get_run(self, keys: list[bytes], staging: Staging | None = None) -> list[torch.Tensor] | None:
        """Payloads of these keys, or None (a miss) if any is absent or its file is damaged.

        Each file is read once, in one call; its blocks are views of one buffer: a new one per
        file, or consecutive pieces of `staging` (valid until its next use)."""
        with self._lock:
            if not self._usable() or any(key not in self.index for key in keys):
                return None
            places = [self.index[key] for key in keys]
        wanted: dict[BlockFile, list[int]] = {}
        for file, i in places:
            wanted.setdefault(file, []).append(i)
        spans = [read_span(file.header, indices) for file, indices in wanted.items()]
        buffers = staging.split([end - start for start, end in spans]) if staging else [None] * len(spans)
        blocks: dict[tuple[BlockFile, int], torch.Tensor] = {}
        for (file, indices), buf in zip(wanted.items(), buffers):   # each file read once
            try:
                blocks.update(zip(((file, i) for i in indices), read_blocks(file.path, file.header, indices, buf)))
            except (BlockFileError, OSError) as e:
                if self._replaced(file):
                    with self._lock:      # a peer evicted or rewrote it: not damage, a miss
                        if self.files.get(file.path) is file:
                            self._drop(file)
                else:
                    self._discard(file, e)
                return None
        with self._lock:
            for file in wanted:
                if self.files.get(file.path) is file:
                    self.files.move_to_end(file.path)
                    file.mtime_ns = time.time_ns()
            self.stats["hit_blocks"] += len(keys)
            self.stats["bytes_read"] += len(keys) * self.block_bytes
        for file in wanted:
            try:
                os.utime(file.path)   # the LRU order survives a restart
            except OSError:
                pass
        return [blocks[place] for place in places]

    def read_run(self, keys: list[bytes], staging: Staging | None = None) -> list[torch.Tensor] | None:
        """The tier protocol's read: payloads (in `staging`, valid until its next use) or None."""
        return self.get_run(keys, staging)

    def release(self, keys: list[bytes]) -> None:
        """Nothing is leased: a read owns its buffer."""

    def _replaced(self, file: BlockFile) -> bool:
        try:
            return os.stat(file.path).st_ino != file.inode
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def _open(self) -> bool:
        """Make the directory and index what it holds, the scan outside the lock (lookups never wait on it); on
        failure, disable the tier. Whether it serves now."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.directory} is not writable")
            with self._lock:
                known = dict(self.files)
            found = self._scan(known)
        except OSError as e:
            self._disable(f"cannot use {self.directory}: {e}")
            return False
        with self._lock:
            self._take(found)
            self.loaded = True
        return True

    def _side_bytes(self) -> int:
        """Bytes of the side stores and the fingerprints. A side store's directory is summed again only when its
        mtime moved: its files are written by rename and removed, each of which touches the directory."""
        total = 0
        for name in SIDE_STORES:
            path = os.path.join(self.directory, name)
            try:
                mtime = os.stat(path, follow_symlinks=False).st_mtime_ns
                if self._side.get(name, (None,))[0] != mtime:
                    entries, _ = regular_files(path)
                    self._side[name] = (mtime, sum(e.stat(follow_symlinks=False).st_size for e in entries))
                total += self._side[name][1]
            except OSError:      # none yet, or not a directory we can read
                continue
        with contextlib.suppress(OSError):
            total += os.stat(os.path.join(self.directory, FINGERPRINTS), follow_symlinks=False).st_size
        return total

    def _usable(self) -> bool:
        """(Under the lock.) Whether the tier serves now. A disabled tier serves again once its back-off ends;
        one whose index must be built again first (`_reopen_due`) waits for the next write to build it."""
        if self.disabled_until is None:
            return True
        if time.monotonic() < self.disabled_until or not self.loaded:
            return False
        self.disabled_until = None
        log.warning("disk tier enabled again: %s", self.directory)
        return True

    def _reopen_due(self) -> bool:
        """(Under the lock.) Whether the back-off of a tier without an index has ended: the writer (the saver's
        thread) then scans the directory again, never a lookup. Claims the attempt."""
        if self.loaded or time.monotonic() < self.disabled_until:
            return False
        self.disabled_until = None
        return True

    def _sync(self) -> None:
        """Make the index what the directory holds now; the scan runs outside the lock."""
        with self._lock:
            known = dict(self.files)
        found = self._scan(known)
        with self._lock:
            self._take(found)

    def _scan(self, known: dict[str, BlockFile]) -> list[BlockFile]:
        """The compatible files in the directory; headers are read only for files not known yet. Temp files
        of dead writers and damaged files are deleted, anything but a regular file skipped; one warning for
        each kind."""
        found, damaged, skipped = [], [], []
        shards, other = regular_subdirs(self.directory)
        skipped += other
        for shard in shards:
            try:
                entries, other = regular_files(shard.path)
            except OSError as e:
                skipped.append(f"{shard.name} ({e})")
                continue
            skipped += [f"{shard.name}/{name}" for name in other]
            for entry in entries:
                if entry.name.endswith(TMP_SUFFIX):
                    if is_stale_temp(entry.path):     # a write cut short by a crash
                        remove(entry.path)
                elif entry.name.endswith(SUFFIX):
                    try:
                        stat = entry.stat(follow_symlinks=False)
                        same = known.get(entry.path)
                        if same is not None and same.inode == stat.st_ino:
                            header = same.header
                            mtime_ns = max(stat.st_mtime_ns, same.mtime_ns)
                        else:
                            header, mtime_ns = read_header(entry.path), stat.st_mtime_ns
                    except UnknownVersion:
                        continue
                    except FileNotFoundError:     # a peer evicted it meanwhile
                        continue
                    except (BlockFileError, OSError) as e:
                        damaged.append(str(e))
                        remove(entry.path)
                        continue
                    if self._compatible(header):
                        found.append(BlockFile(entry.path, stat.st_size, header, stat.st_ino, mtime_ns))
        if damaged:
            self.stats["damaged_removed"] += len(damaged)     # a counter: no lock (the scan may run under it)
            log.warning("disk tier deleted %d damaged file(s) in %s, e.g. %s", len(damaged), self.directory,
                        damaged[0])
        if skipped:
            log.warning("disk tier skipped %d entries that are not regular files or directories in %s, e.g. %s",
                        len(skipped), self.directory, skipped[0])
        return found

    def _take(self, found: list[BlockFile]) -> None:
        """(Under the lock.) Index these files, least recently used (oldest mtime) first."""
        self.files.clear()
        self.index.clear()
        self.bytes_used = 0
        for file in sorted(found, key=lambda f: (f.mtime_ns, f.path)):
            self._add(file)

    def _compatible(self, header: Header) -> bool:
        return (header.namespace == self.namespace and header.dtype == dtype_name(self.dtype)
                and header.block_shape == self.block_shape)

    def _add(self, file: BlockFile) -> None:
        if file.path in self.files:            # rewritten in place: forget the old version
            self._drop(self.files[file.path])
        self.files[file.path] = file
        for i, key in enumerate(file.header.keys):
            self.index[key] = (file, i)
        self.bytes_used += file.size

    def _drop(self, file: BlockFile) -> None:
        del self.files[file.path]
        for key in file.header.keys:
            if self.index.get(key, (None,))[0] is file:
                del self.index[key]
        self.bytes_used -= file.size

    def _evict(self, limit: int) -> None:
        """Delete least recently used files until at most `limit` bytes are used, skipping those a peer is reading.
        The lock is taken only to pick and to drop a file, never across an unlink: lookups do not wait on the disk.
        A reader that finds a file gone meanwhile takes the miss."""
        with self._lock:
            oldest_first = list(self.files.values())
        for file in oldest_first:
            with self._lock:
                if self.bytes_used <= limit:
                    return
                if self.files.get(file.path) is not file:     # dropped meanwhile
                    continue
            if remove_unless_read(file.path):
                with self._lock:
                    if self.files.get(file.path) is file:
                        self._drop(file)
                        self.stats["evictions"] += 1

    def _make_room(self, size: int) -> bool:
        """After a full disk: evict at least `size` bytes more of our files; False if there were none."""
        with self._lock:
            if not self.files:
                return False
            limit = max(0, self.bytes_used - size)
            self.stats["retries"] += 1
        self._evict(limit)
        return True

    def _discard(self, file: BlockFile, error: Exception) -> None:
        """Drop a file that failed to read (unless eviction already did), and delete it."""
        with self._lock:
            if self.files.get(file.path) is not file:
                return
            self._drop(file)
            self.stats["errors"] += 1
        remove(file.path)
        log.warning("disk tier dropped a damaged file, its blocks will be recomputed: %s", error)

    def _disable(self, reason: str) -> None:
        with self._lock:
            self._disable_locked(reason)

    def _disable_locked(self, reason: str) -> None:
        if self.disabled_until is not None:
            return
        self.disabled_until = time.monotonic() + self.backoff_s
        self.stats["errors"] += 1
        log.warning("disk tier disabled for %.0f s, caching continues in the other tiers: %s", self.backoff_s, reason)
        self.backoff_s = min(2 * self.backoff_s, MAX_BACKOFF_S)


def regular_subdirs(directory: str) -> tuple[list[os.DirEntry], list[str]]:
    """The shard directories (two-character names, real directories), and the names of two-character
    entries skipped as anything else (other names are not ours: the manifests, the digest cache)."""
    shards, skipped = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            if len(entry.name) != 2:
                continue
            try:
                real_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                real_dir = False
            (shards.append(entry) if real_dir else skipped.append(entry.name))
    return shards, skipped


def remove_unless_read(path: str) -> bool:
    """Delete a block file unless another process holds a read lock on it; True if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return True
    except OSError:
        remove(path)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    try:
        remove(path)
        return True
    finally:
        os.close(fd)
