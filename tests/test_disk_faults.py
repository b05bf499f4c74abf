"""A disk tier that heals: a full disk (a real, small tmpfs), I/O errors, other processes' temp files,
entries that are not regular files, and manifests written like block files."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading

import pytest
import torch
from test_disk_tier import BLOCK_BYTES, SHAPE, files, keys_for, make_tier, payloads_for

from kvtier.kv import manifest as manifest_module
from kvtier.kv.manifest import Manifest, ManifestStore
from kvtier.kv.tiers import disk as disk_module
from kvtier.kv.tiers.blockfile import file_size

RUN = file_size(4, len(SHAPE), BLOCK_BYTES)     # one run of 4 blocks
RUN_ON_DISK = -(-RUN // 4096) * 4096             # what it takes of a file system of 4 KiB pages


@contextlib.contextmanager
def small_disk(path, size: int):
    """A real file system of `size` bytes (tmpfs; mounting needs root, as CI runs)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def put_runs(tier, n: int, first_seed: int = 0) -> list[list[bytes]]:
    runs = [keys_for(4, seed=s) for s in range(first_seed, first_seed + n)]
    for keys in runs:
        tier.put_run(keys, payloads_for(4, seed=keys[0][0]))
    return runs


def test_a_budget_as_large_as_the_disk_evicts_before_writing(tmp_path):
    with small_disk(tmp_path / "disk", 6 * RUN_ON_DISK) as disk:
        tier = make_tier(disk, budget=6 * RUN)        # the budget is all the free space there is
        runs = put_runs(tier, 20)
        assert tier.enabled and tier.stats["errors"] == 0
        assert len(files(disk)) == 6 and [tier.match_prefix(k) for k in runs[-6:]] == [4] * 6
        assert tier.bytes_used <= tier.budget_bytes


def test_a_disk_filled_by_others_makes_room_and_retries(tmp_path):
    with small_disk(tmp_path / "disk", 8 * RUN_ON_DISK) as disk:
        tier = make_tier(disk, budget=100 * RUN)      # a budget far beyond the disk
        put_runs(tier, 4)
        (disk / "someone-else").write_bytes(b"\0" * (4 * RUN_ON_DISK - 4096))   # the rest of the disk
        runs = put_runs(tier, 3, first_seed=10)
        assert tier.enabled and tier.stats["retries"] >= 1 and tier.stats["errors"] == 0
        assert [tier.match_prefix(k) for k in runs] == [4, 4, 4]


def test_a_tier_disabled_by_errors_enables_itself_after_a_backoff(tmp_path, monkeypatch):
    def broken(fd, buffers):
        raise OSError(errno.EIO, "Input/output error")
    tier = make_tier(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(os, "writev", broken)
        put_runs(tier, 1)
    assert not tier.enabled and tier.stats["errors"] == 1
    assert tier.disabled_until is not None and tier.backoff_s == 2 * disk_module.FIRST_BACKOFF_S
    tier.disabled_until -= disk_module.FIRST_BACKOFF_S      # the back-off has passed
    runs = put_runs(tier, 2, first_seed=5)
    assert tier.enabled and [tier.match_prefix(k) for k in runs] == [4, 4]


def test_a_directory_unusable_at_startup_is_tried_again(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the directory should be")
    tier = make_tier(blocker)
    assert not tier.enabled
    blocker.unlink()
    tier.disabled_until -= disk_module.FIRST_BACKOFF_S
    assert tier.match_prefix(keys_for(1)) == 0 and not tier.enabled    # a lookup never scans the directory
    runs = put_runs(tier, 1)                                            # the next write does
    assert tier.enabled and tier.match_prefix(runs[0]) == 4


def held_by_another_process(path) -> subprocess.Popen:
    """A process that creates path and holds its lock, as a writer does while it writes; stop it to let go."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys; f = open(sys.argv[1], 'wb'); f.write(b'half a file'); f.flush(); "
        "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()"), str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def test_startup_removes_only_temp_files_no_writer_holds(tmp_path):
    """Liveness is the writer's lock, not a process id: a temp file named after this very process (as one from a
    crashed server in another PID namespace may be) but held by no one is a leftover; one held by a live writer
    stays, whatever its name says."""
    keys = put_runs(make_tier(tmp_path), 1)[0]
    shard = next(p for p in tmp_path.iterdir() if p.is_dir())
    live = shard / f"{keys[0].hex()}.kvb.999999.abc123.tmp"           # another server, writing right now
    dead = shard / f"{keys[0].hex()}.kvb.{os.getpid()}.def456.tmp"    # a server killed mid-write, its pid reused
    writer = held_by_another_process(live)
    try:
        dead.write_bytes(b"half a file")
        tier = make_tier(tmp_path)
        assert live.exists() and not dead.exists() and tier.match_prefix(keys) == 4
    finally:
        writer.communicate("")
    make_tier(tmp_path)          # its writer gone, the next start-up takes it for a leftover
    assert not live.exists()


def test_entries_that_are_not_regular_files_are_skipped_one_by_one(tmp_path, caplog):
    runs = put_runs(make_tier(tmp_path), 2)
    shard = next(p for p in tmp_path.iterdir() if p.is_dir())
    os.mkfifo(shard / ("f" * 32 + ".kvb"))                  # would block a reader forever
    os.symlink("loop.kvb", shard / "loop.kvb")                # a link to itself
    (shard / ("d" * 32 + ".kvb")).mkdir()
    os.symlink(str(tmp_path / "zz"), tmp_path / "zz")         # a looping shard
    os.mkfifo(tmp_path / "yy")
    done = threading.Event()
    result = {}

    def start():
        result["tier"] = make_tier(tmp_path)
        done.set()
    threading.Thread(target=start, daemon=True).start()
    assert done.wait(30), "start-up hung"
    tier = result["tier"]
    assert tier.enabled and [tier.match_prefix(k) for k in runs] == [4, 4]
    assert any("not regular files" in r.getMessage() for r in caplog.records)


def manifest(n: int) -> Manifest:
    keys = keys_for(n)
    tensors = {name: torch.zeros(n, 2, 2, 8) for name in ("kmin", "kmax", "kmean")} | {"scores": torch.zeros(n)}
    return Manifest(keys, [True] * n, list(range(n)), 0, [], tensors)


def test_a_kept_manifest_stays_in_memory_until_written_and_a_discarded_one_is_not_written(tmp_path):
    """Manifests kept as their sequences finish are found until their writes (after their blocks' saves) land, however
    many finish meanwhile; after that memory keeps only the newest; one discarded before its write is never written."""
    store = ManifestStore(b"bounded-ns-01234", str(tmp_path))
    keys = [keys_for(20 + i)[-1] for i in range(manifest_module.MAX_IN_MEMORY + 4)]
    for key in keys:
        store.keep(key, manifest(3))
    assert all(store.block_keys(key) == keys_for(3) for key in keys)
    store.discard(keys[0])
    for key in keys:
        store.write(key, manifest(3))
    assert not (tmp_path / (keys[0].hex() + manifest_module.SUFFIX)).exists() and store.block_keys(keys[0]) is None
    store.keep(keys_for(99)[-1], manifest(3))
    assert len(store._memory) == manifest_module.MAX_IN_MEMORY
    assert all(store.block_keys(key) == keys_for(3) for key in keys[1:])      # from the files now


def test_manifests_are_written_like_block_files_and_fifos_never_hang_startup(tmp_path):
    directory = tmp_path / "manifests"
    store = ManifestStore(b"bounded-ns-01234", str(directory))
    key = keys_for(5)[-1]
    store.keep(key, manifest(3))
    store.write(key, manifest(3))
    path = directory / (key.hex() + manifest_module.SUFFIX)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in directory.iterdir()] == [path.name]     # no temp file left
    os.mkfifo(directory / ("e" * 32 + manifest_module.SUFFIX))
    stale = directory / f"{path.name}.x1y2z3.tmp"
    stale.write_bytes(b"cut short")
    done = threading.Event()
    result = {}

    def start():
        result["store"] = ManifestStore(b"bounded-ns-01234", str(directory))
        done.set()
    threading.Thread(target=start, daemon=True).start()
    assert done.wait(30), "start-up hung on a FIFO"
    again = result["store"]
    assert again.block_keys(key) == keys_for(3) and again.get(key).keys == keys_for(3)
    assert not stale.exists()
