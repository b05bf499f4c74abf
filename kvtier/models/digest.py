"""Digests of whole weight files, for the model's fingerprint.

Every byte is hashed (xxh3-128, streaming), so any change to the weights is a new cache
namespace. A digest is remembered in a small JSON file beside the KV cache, by the file's
real path, size, inode, modification time and change time, so a restart does not read the
weights twice. The change time is the kernel's (no copy keeps it): another file put at the
path with the old one's size and modification time (`cp -p`, `rsync -a`) is hashed again.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile

import xxhash

log = logging.getLogger("kvtier.models")

CHUNK_BYTES = 16 << 20


def file_digest(path: str, cache_path: str | None = None) -> str:
    """The xxh3-128 hex digest of every byte of the file at path; cache_path: where digests are remembered."""
    stat = os.stat(path)
    key, stamp = os.path.realpath(path), [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]
    cache = _read_cache(cache_path) if cache_path else {}
    entry = cache.get(key)
    if isinstance(entry, list) and entry[:-1] == stamp:
        return str(entry[-1])
    digest = _hash_file(path)
    if cache_path:
        cache[key] = [*stamp, digest]
        _write_cache(cache_path, cache)
    return digest


def _hash_file(path: str) -> str:
    h = xxhash.xxh3_128()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _read_cache(cache_path: str) -> dict:
    try:
        with open(cache_path) as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):   # absent or damaged: hash again
        return {}


def _write_cache(cache_path: str, cache: dict) -> None:
    """Atomically, through a temp file of our own (another server may write the same cache)."""
    directory = os.path.dirname(cache_path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fingerprints-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, cache_path)
    except OSError as e:
        log.warning("could not remember weight digests in %s: %s", cache_path, e)
