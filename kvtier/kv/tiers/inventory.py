"""What a disk tier directory holds, and clearing it: `kvtier cache` (info | clear).

Both work on a directory that running servers share: clearing takes the writers' lock, and a
server that looks for a block cleared under it takes the miss and computes it again.
"""
from __future__ import annotations

import fcntl
import os
from collections import defaultdict
from contextlib import contextmanager

from kvtier.kv.tiers.blockfile import BlockFileError, read_header
from kvtier.kv.tiers.disk import FINGERPRINTS, LOCK_NAME, SIDE_STORES, SUFFIX, regular_subdirs
from kvtier.kv.tiers.files import TMP_SUFFIX, regular_files, remove


def survey(directory: str) -> dict:
    """Block files per namespace (with their dtype and block shape), the side stores, and what is not ours."""
    namespaces: dict[tuple, dict] = defaultdict(lambda: {"files": 0, "blocks": 0, "bytes": 0})
    report = {"directory": directory, "namespaces": [], "damaged": 0, "temp_files": 0, "bytes": 0}
    for path, size in _block_files(directory):
        if path.endswith(TMP_SUFFIX):
            report["temp_files"] += 1
            continue
        try:
            header = read_header(path)
        except (BlockFileError, OSError):
            report["damaged"] += 1
            continue
        entry = namespaces[(header.namespace.hex(), header.dtype, header.block_shape)]
        entry["files"] += 1
        entry["blocks"] += len(header.keys)
        entry["bytes"] += size
        report["bytes"] += size
    for (ns, dtype, shape), entry in sorted(namespaces.items(), key=lambda kv: -kv[1]["bytes"]):
        report["namespaces"].append({"namespace": ns, "dtype": dtype, "block_shape": list(shape), **entry})
    for name, suffix in SIDE_STORES.items():
        found = [size for path, size in _side_files(directory, name) if path.endswith(suffix)]
        report[name] = {"files": len(found), "bytes": sum(found)}
        report["bytes"] += sum(found)
    return report


def clear(directory: str) -> dict:
    """Delete every block file, manifest, partial-block entry, saved rate, kept conversation and the weights'
    fingerprints (and leftover temp files), holding the writers' lock; what else is in the directory stays.
    Returns what was deleted."""
    removed = {"files": 0, "bytes": 0}
    with _writers_lock(directory):
        victims = list(_block_files(directory))
        fingerprints = os.path.join(directory, FINGERPRINTS)
        if os.path.isfile(fingerprints) and not os.path.islink(fingerprints):
            victims.append((fingerprints, os.stat(fingerprints).st_size))
        for name, suffix in SIDE_STORES.items():
            victims += [(p, s) for p, s in _side_files(directory, name) if p.endswith((suffix, TMP_SUFFIX))]
        for path, size in victims:
            if path.endswith((SUFFIX, TMP_SUFFIX, *SIDE_STORES.values())):   # .json: rates, responses, fingerprints
                remove(path)
                removed["files"] += 1
                removed["bytes"] += size
    return removed


def _block_files(directory: str):
    """(path, size) of the block files and temp files in the shard directories."""
    shards, _ = regular_subdirs(directory)
    for shard in shards:
        entries, _ = regular_files(shard.path)
        for entry in entries:
            if entry.name.endswith((SUFFIX, TMP_SUFFIX)):
                yield entry.path, entry.stat(follow_symlinks=False).st_size


def _side_files(directory: str, name: str):
    path = os.path.join(directory, name)
    if not os.path.isdir(path) or os.path.islink(path):
        return
    entries, _ = regular_files(path)
    for entry in entries:
        yield entry.path, entry.stat(follow_symlinks=False).st_size


@contextmanager
def _writers_lock(directory: str):
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
