"""Disk tier: block files survive restarts, bad data is a miss, budgets hold, bad disks degrade."""
from __future__ import annotations

import errno
import logging
import os
import struct

import pytest
import torch

from kvtier.kv.keys import chain_keys
from kvtier.kv.tiers import blockfile
from kvtier.kv.tiers.blockfile import file_size, read_header
from kvtier.kv.tiers.disk import DiskTier
from kvtier.kv.tiers.staging import Staging

SHAPE = (2, 2, 4, 2, 8)      # kv, layers, block_size, kv heads, head dim
NS = b"namespace-0123ab"
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return chain_keys(list(range(seed * 1000, seed * 1000 + n * SHAPE[2])), SHAPE[2], NS)


def payloads_for(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n)]


def make_tier(path, budget: int = 1 << 30, namespace: bytes = NS, shape=SHAPE, dtype=torch.float32) -> DiskTier:
    return DiskTier(str(path), budget, namespace, shape, dtype)


def files(path, pattern: str = "*.kvb") -> list:
    return sorted(path.rglob(pattern))


def file_of(path, key: bytes):
    return path / key.hex()[:2] / (key.hex() + ".kvb")


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier.kv.disk" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_survives_restart(tmp_path, dtype):
    keys, payloads = keys_for(5), payloads_for(5, dtype)
    make_tier(tmp_path, dtype=dtype).put_run(keys, payloads, token_counts=[4] * 5)

    tier = make_tier(tmp_path, dtype=dtype)
    assert tier.match_prefix(keys) == 5
    got = tier.get_run(keys)
    assert len(got) == 5
    for a, b in zip(got, payloads):
        assert a.dtype == dtype and a.shape == SHAPE and a.device.type == "cpu"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    header = read_header(str(file_of(tmp_path, keys[0])))
    assert header.keys == keys and header.token_counts == [4] * 5
    assert tier.stats["hit_blocks"] == 5 and tier.stats["bytes_read"] == 5 * tier.block_bytes


def test_index_is_rebuilt_from_headers_only(tmp_path, caplog):
    keys = keys_for(3)
    make_tier(tmp_path).put_run(keys, payloads_for(3))
    path = file_of(tmp_path, keys[0])
    flip_byte(path, os.path.getsize(path) - 1)        # last payload byte

    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        tier = make_tier(tmp_path)
        assert all(tier.contains(k) for k in keys)    # payloads were not read at start-up
        assert warnings_in(caplog) == []
        assert tier.get_run(keys) is None
        assert tier.get_run(keys) is None
    assert len(warnings_in(caplog)) == 1 and "checksum" in warnings_in(caplog)[0]
    assert not path.exists() and not tier.contains(keys[0])
    assert tier.bytes_used == 0 and tier.stats["errors"] == 1


def test_match_prefix_stops_at_a_gap(tmp_path):
    keys, payloads = keys_for(6), payloads_for(6)
    tier = make_tier(tmp_path)
    tier.put_run(keys[:2], payloads[:2])
    tier.put_run(keys[3:], payloads[3:])
    assert tier.match_prefix(keys) == 2
    assert tier.match_prefix(keys[3:]) == 3
    assert tier.get_run(keys) is None

    tier.put_run(keys[2:3], payloads[2:3])
    assert tier.match_prefix(keys) == 6
    assert all(torch.equal(a, b) for a, b in zip(tier.get_run(keys), payloads))   # across three files
    assert tier.stats["lookups"] == 3


def test_staging_buffer_is_reused_and_bounded(tmp_path):
    tier = make_tier(tmp_path)
    keys, payloads = keys_for(6), payloads_for(6)
    tier.put_run(keys[:3], payloads[:3])
    tier.put_run(keys[3:], payloads[3:])
    staging = Staging(torch.zeros(1 << 20, dtype=torch.uint8))
    got = tier.get_run(keys, staging)                        # two files, one after the other in the buffer
    assert all(torch.equal(a, b) for a, b in zip(got, payloads))
    assert all(block.untyped_storage().data_ptr() == staging.buffer.data_ptr() for block in got)
    got = tier.get_run(keys[3:], staging)
    assert all(torch.equal(a, b) for a, b in zip(got, payloads[3:]))
    assert got[0].untyped_storage().data_ptr() == staging.buffer.data_ptr()
    small = Staging(torch.zeros(BLOCK_BYTES, dtype=torch.uint8))     # too small: fresh buffers, same data
    got = tier.get_run(keys, small)
    assert all(torch.equal(a, b) for a, b in zip(got, payloads))
    assert all(block.untyped_storage().data_ptr() != small.buffer.data_ptr() for block in got)


def test_budget_evicts_the_least_recently_used_file(tmp_path):
    size = file_size(2, len(SHAPE), BLOCK_BYTES)
    tier = make_tier(tmp_path, budget=2 * size)
    a, b, c = (keys_for(2, seed=s) for s in range(3))
    tier.put_run(a, payloads_for(2))
    tier.put_run(b, payloads_for(2))
    assert tier.get_run(a) is not None                 # a is now more recent than b
    tier.put_run(c, payloads_for(2))

    assert tier.match_prefix(a) == 2 and tier.match_prefix(c) == 2
    assert tier.match_prefix(b) == 0 and not file_of(tmp_path, b[0]).exists()
    assert tier.bytes_used == 2 * size <= tier.budget_bytes
    assert tier.stats["evictions"] == 1


def test_the_budget_covers_everything_kvtier_keeps_in_the_directory(tmp_path):
    """Side stores (manifests, partial blocks, rates, kept conversations) and the fingerprints count against
    --kv-disk-gib too: block files yield to them, at start-up and at each write."""
    size = file_size(2, len(SHAPE), BLOCK_BYTES)
    tier = make_tier(tmp_path, budget=4 * size)
    runs = [keys_for(2, seed=s) for s in range(4)]
    for keys in runs[:3]:
        tier.put_run(keys, payloads_for(2))
    assert tier.bytes_used == 3 * size
    (tmp_path / "responses").mkdir()
    (tmp_path / "responses" / "resp_1.json").write_bytes(b"x" * (size + 1))   # a kept conversation
    (tmp_path / "fingerprints.json").write_bytes(b"{}")

    def on_disk() -> int:
        return sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock")
    tier.put_run(runs[3], payloads_for(2))        # room for it and the conversation: the two oldest runs go
    assert on_disk() <= tier.budget_bytes and tier.bytes_used == 2 * size
    assert [tier.match_prefix(keys) for keys in runs] == [0, 0, 2, 2]
    (tmp_path / "responses" / "resp_2.json").write_bytes(b"x" * size)         # another, written by a peer
    tier = make_tier(tmp_path, budget=4 * size)   # a restart takes it into account
    assert on_disk() <= tier.budget_bytes and [tier.match_prefix(keys) for keys in runs] == [0, 0, 0, 2]


def test_lookups_never_wait_on_an_eviction_s_unlink(tmp_path, monkeypatch):
    """The engine thread's lookups take the tier's lock: an unlink stalled in the saver's eviction must not hold
    it (a slow or remote file system would stall every step)."""
    import threading

    from kvtier.kv.tiers import disk
    size = file_size(2, len(SHAPE), BLOCK_BYTES)
    tier = make_tier(tmp_path, budget=2 * size)
    a, b, c = (keys_for(2, seed=s) for s in range(3))
    tier.put_run(a, payloads_for(2))
    tier.put_run(b, payloads_for(2))
    unlinking, release = threading.Event(), threading.Event()
    real = disk.remove_unless_read

    def stalled(path):
        unlinking.set()
        release.wait(30)
        return real(path)
    monkeypatch.setattr(disk, "remove_unless_read", stalled)
    saver = threading.Thread(target=tier.put_run, args=(c, payloads_for(2)))
    saver.start()
    try:
        assert unlinking.wait(10)
        looked = []
        lookup = threading.Thread(target=lambda: looked.append((tier.match_prefix(b), tier.contains(a[0]))))
        lookup.start()
        lookup.join(10)
        assert looked == [(2, True)] and saver.is_alive()     # answered while the unlink is still stalled
    finally:
        release.set()
        saver.join(10)
    assert tier.match_prefix(c) == 2 and tier.match_prefix(a) == 0 and tier.bytes_used == 2 * size


def test_restart_keeps_the_lru_order_by_mtime(tmp_path):
    size = file_size(2, len(SHAPE), BLOCK_BYTES)
    a, b = keys_for(2, seed=0), keys_for(2, seed=1)
    tier = make_tier(tmp_path)
    tier.put_run(a, payloads_for(2))
    tier.put_run(b, payloads_for(2))
    os.utime(file_of(tmp_path, a[0]), (1e9, 1e9))
    os.utime(file_of(tmp_path, b[0]), (1.1e9, 1.1e9))  # b newer on disk ...
    assert tier.get_run(a) is not None                 # ... until a is read

    tier = make_tier(tmp_path, budget=size)            # a smaller budget at restart
    assert tier.match_prefix(a) == 2 and tier.match_prefix(b) == 0
    assert files(tmp_path) == [file_of(tmp_path, a[0])]


def test_truncated_file_is_a_miss(tmp_path, caplog):
    keys = keys_for(3)
    tier = make_tier(tmp_path)
    tier.put_run(keys, payloads_for(3))
    path = file_of(tmp_path, keys[0])
    os.truncate(path, os.path.getsize(path) // 2)

    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        assert tier.get_run(keys) is None
    assert len(warnings_in(caplog)) == 1 and "truncated" in warnings_in(caplog)[0]
    assert tier.match_prefix(keys) == 0 and not path.exists()


def test_truncated_file_is_skipped_at_startup(tmp_path, caplog):
    keys = keys_for(3)
    make_tier(tmp_path).put_run(keys, payloads_for(3))
    path = file_of(tmp_path, keys[0])
    os.truncate(path, os.path.getsize(path) - 1)

    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        tier = make_tier(tmp_path)
    assert tier.match_prefix(keys) == 0 and tier.bytes_used == 0
    assert len(warnings_in(caplog)) == 1 and "truncated" in warnings_in(caplog)[0]


def test_flipped_payload_byte_fails_the_checksum(tmp_path, caplog):
    keys, payloads = keys_for(3), payloads_for(3)
    tier = make_tier(tmp_path)
    tier.put_run(keys, payloads)
    path = file_of(tmp_path, keys[0])
    flip_byte(path, read_header(str(path)).offsets[1] + 17)

    assert torch.equal(tier.get_run(keys[:1])[0], payloads[0])   # block 0 is intact
    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        assert tier.get_run(keys) is None
    assert len(warnings_in(caplog)) == 1 and "block 1 fails its checksum" in warnings_in(caplog)[0]


@pytest.mark.parametrize("other", [{"namespace": b"another-model-ns"}, {"dtype": torch.bfloat16},
                                   {"shape": (2, 2, 4, 2, 16)}])
def test_files_of_another_namespace_dtype_or_shape_are_ignored(tmp_path, caplog, other):
    keys = keys_for(2)
    make_tier(tmp_path).put_run(keys, payloads_for(2))

    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        foreign = make_tier(tmp_path, **other)
    assert warnings_in(caplog) == []
    assert not foreign.contains(keys[0]) and foreign.match_prefix(keys) == 0 and foreign.get_run(keys) is None
    assert foreign.bytes_used == 0
    assert file_of(tmp_path, keys[0]).exists()          # left alone for its own model
    assert make_tier(tmp_path).match_prefix(keys) == 2


def test_damaged_files_are_deleted_at_startup_and_other_versions_left_alone(tmp_path, caplog):
    runs = [keys_for(2, seed=s) for s in range(3)]
    tier = make_tier(tmp_path)
    for keys in runs:
        tier.put_run(keys, payloads_for(2))
    bad_magic, bad_header, new_version = (file_of(tmp_path, keys[0]) for keys in runs)
    with open(bad_magic, "r+b") as f:
        f.write(b"NOTKVTR\0")
    flip_byte(bad_header, blockfile.PREFIX.size + 3)   # inside the namespace
    with open(new_version, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", blockfile.VERSION + 1))

    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        tier = make_tier(tmp_path)
    assert all(tier.match_prefix(keys) == 0 for keys in runs)
    assert len(warnings_in(caplog)) == 1 and "deleted 2 damaged" in warnings_in(caplog)[0]
    assert files(tmp_path) == [new_version]       # damaged files never linger outside the budget
    assert tier.bytes_used == 0 and tier.stats["damaged_removed"] == 2


def test_unwritable_directory_disables_the_tier(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    keys = keys_for(2)
    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        tier = make_tier(blocker / "cache")
        tier.put_run(keys, payloads_for(2))
        tier.put_run(keys, payloads_for(2))
    assert not tier.enabled and len(warnings_in(caplog)) == 1
    assert not tier.contains(keys[0]) and tier.match_prefix(keys) == 0 and tier.get_run(keys) is None
    assert tier.stats["bytes_written"] == 0


def test_full_disk_disables_the_tier(tmp_path, caplog, monkeypatch):
    def no_space(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(blockfile.os, "writev", no_space)
    tier = make_tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        tier.put_run(keys_for(2), payloads_for(2))
        tier.put_run(keys_for(2, seed=1), payloads_for(2))
    assert not tier.enabled and len(warnings_in(caplog)) == 1 and "No space" in warnings_in(caplog)[0]
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".lock"]   # no temp file left behind


def test_put_leaves_no_temp_files_and_startup_removes_leftovers(tmp_path, caplog):
    keys = keys_for(2)
    make_tier(tmp_path).put_run(keys, payloads_for(2))
    assert files(tmp_path, "*.tmp") == []
    leftover = file_of(tmp_path, keys[0]).parent / "ff00.kvb.crash.tmp"
    leftover.write_bytes(b"half a file")

    with caplog.at_level(logging.WARNING, logger="kvtier.kv.disk"):
        tier = make_tier(tmp_path)
    assert not leftover.exists() and warnings_in(caplog) == []
    assert tier.match_prefix(keys) == 2


def test_put_writes_only_new_blocks(tmp_path):
    keys, payloads = keys_for(3), payloads_for(3)
    tier = make_tier(tmp_path)
    tier.put_run(keys[:2], payloads[:2])
    written = tier.stats["bytes_written"]
    assert written == file_size(2, len(SHAPE), BLOCK_BYTES)

    tier.put_run(keys[:2], payloads[:2])
    assert tier.stats["bytes_written"] == written and len(files(tmp_path)) == 1

    tier.put_run(keys, payloads)
    assert len(files(tmp_path)) == 2
    assert read_header(str(file_of(tmp_path, keys[2]))).keys == [keys[2]]
    assert tier.stats["bytes_written"] == written + file_size(1, len(SHAPE), BLOCK_BYTES)
    assert tier.bytes_used == tier.stats["bytes_written"] == sum(p.stat().st_size for p in files(tmp_path))


def test_run_larger_than_the_budget_is_not_written(tmp_path):
    tier = make_tier(tmp_path, budget=file_size(2, len(SHAPE), BLOCK_BYTES))
    tier.put_run(keys_for(3), payloads_for(3))
    assert files(tmp_path) == [] and tier.enabled


def test_put_rejects_payloads_that_do_not_fit_the_tier(tmp_path):
    tier = make_tier(tmp_path)
    with pytest.raises(ValueError, match="not a CPU"):
        tier.put_run(keys_for(1), [torch.zeros(2, 2, 4, 2, 4)])
    with pytest.raises(ValueError, match="not a CPU"):
        tier.put_run(keys_for(1), payloads_for(1, torch.float16))
    with pytest.raises(ValueError, match="2 keys, 1 payloads"):
        tier.put_run(keys_for(2), payloads_for(1))
    assert files(tmp_path, "*.tmp") == [] and tier.enabled
    with pytest.raises(ValueError, match="16 bytes"):
        make_tier(tmp_path, namespace=b"short")
