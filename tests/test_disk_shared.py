"""One disk tier directory shared by several processes, and `kvtier cache` on it."""
from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import subprocess
import sys

import torch

from kvtier.kv.keys import chain_keys
from kvtier.kv.tiers.blockfile import file_size
from kvtier.kv.tiers.disk import LOCK_NAME, DiskTier
from kvtier.server.responses import ResponseStore

SHAPE = (2, 2, 4, 2, 8)
NS = b"namespace-shared"
RUN_BLOCKS, RUNS = 3, 24
FILE_BYTES = file_size(RUN_BLOCKS, len(SHAPE), 2 * 2 * 4 * 2 * 8 * 4)


def run_of(i: int) -> tuple[list[bytes], list[torch.Tensor]]:
    """Run i: its keys and payloads, the same in every process (content-addressed)."""
    g = torch.Generator().manual_seed(i)
    keys = chain_keys(list(range(i * 1000, i * 1000 + RUN_BLOCKS * SHAPE[2])), SHAPE[2], NS)
    return keys, [torch.randn(SHAPE, generator=g) for _ in range(RUN_BLOCKS)]


def on_disk(directory: str) -> int:
    """Bytes of the block files in the directory, sampled under the writers' lock. Unlocked, a walk that
    counted a file a peer then evicted could also count the file it wrote next, which never coexisted."""
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return sum(os.path.getsize(os.path.join(root, name))
                   for root, _, names in os.walk(directory) for name in names if name.endswith(".kvb"))
    finally:
        os.close(fd)


def hammer(directory: str, seed: int, budget: int, rounds: int, results) -> None:
    """Write and read random runs; count wrong payloads and the most bytes ever seen on disk."""
    tier = DiskTier(directory, budget, NS, SHAPE, torch.float32)
    rng = random.Random(seed)
    wrong = hits = peak = 0
    for _ in range(rounds):
        tier.put_run(*run_of(rng.randrange(RUNS)))
        keys, payloads = run_of(rng.randrange(RUNS))
        got = tier.get_run(keys)
        if got is not None:
            hits += 1
            wrong += not all(torch.equal(a, b) for a, b in zip(got, payloads))
        peak = max(peak, on_disk(directory))
    results.put({"stats": dict(tier.stats), "wrong": wrong, "hits": hits, "peak": peak})


def in_processes(target, args_per_process: list[tuple]) -> list[dict]:
    """Run target(*args, results) in one spawned process per args; what each put on results."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in args_per_process]
    for p in procs:
        p.start()
    reports = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return reports


def test_processes_sharing_a_directory_keep_one_budget_and_never_read_wrong_bytes(tmp_path):
    budget = 6 * FILE_BYTES                    # a quarter of the runs fit: eviction all the time
    reports = in_processes(hammer, [(str(tmp_path), seed, budget, 80) for seed in range(3)])
    for report in reports:
        assert report["wrong"] == 0 and report["hits"] > 0
        assert report["stats"]["errors"] == 0 and report["stats"]["damaged_removed"] == 0
        assert report["peak"] <= budget
    assert sum(r["stats"]["evictions"] for r in reports) > 0
    assert on_disk(str(tmp_path)) <= budget


def test_a_process_finds_what_another_wrote_after_it_started(tmp_path):
    early = DiskTier(str(tmp_path), 1 << 30, NS, SHAPE, torch.float32)
    late = DiskTier(str(tmp_path), 1 << 30, NS, SHAPE, torch.float32)
    keys, payloads = run_of(1)
    late.put_run(keys, payloads)
    early.put_run(*run_of(2))                  # a write brings early's index up to date with the directory
    assert all(torch.equal(a, b) for a, b in zip(early.get_run(keys), payloads))


def kvtier_cache(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "cache", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cache_command_shows_and_clears_under_a_live_tier(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 30, NS, SHAPE, torch.float32)
    for i in range(3):
        tier.put_run(*run_of(i))
    store = ResponseStore(str(tmp_path / "responses"))
    store.put("resp_1", [{"role": "user", "content": "private words"}])
    store.flush()
    (tmp_path / "fingerprints.json").write_text("{}")
    info = kvtier_cache("--kv-disk-dir", str(tmp_path))
    assert f"namespace {NS.hex()[:16]} (float32, blocks of 2x2x4x2x8): 9 blocks in 3 files" in info
    assert "responses: 1 files" in info
    assert "deleted 5 files" in kvtier_cache("clear", "--kv-disk-dir", str(tmp_path))
    assert on_disk(str(tmp_path)) == 0
    assert not (tmp_path / "responses" / "resp_1.json").exists() and not (tmp_path / "fingerprints.json").exists()
    keys, payloads = run_of(0)
    assert tier.get_run(keys) is None and tier.stats["errors"] == 0    # cleared under it: a plain miss
    tier.put_run(keys, payloads)
    assert all(torch.equal(a, b) for a, b in zip(tier.get_run(keys), payloads))
    assert "0 blocks" not in kvtier_cache("info", "--kv-disk-dir", str(tmp_path))


def serve_prompts(model_dir: str, directory: str, prompts: list[list[int]], order_seed: int, results) -> None:
    """An engine serving prompts in its own order over the shared directory: its tokens and tier stats."""
    from conftest import run_greedy

    from kvtier.config import Config
    from kvtier.engine.engine import LLMEngine
    eng = LLMEngine(Config(model=model_dir, block_size=16, kv_pool_tokens=64 * 16, max_batched_tokens=64,
                           prefix_cache=False, kv_host_gib=0, kv_disk_dir=directory, kv_disk_gib=0.0002))
    order = list(range(len(prompts)))
    random.Random(order_seed).shuffle(order)
    answers = {i: run_greedy(eng, prompts[i], max_tokens=4, logprobs=None).tokens for i in order}
    eng.shutdown()
    results.put({"answers": answers, "disk": dict(eng.tiers.disk.stats)})


def test_engines_in_two_processes_share_a_directory_under_load_and_answer_as_cold(tiny_model_dir, tmp_path):
    """Shared prefixes, a disk budget of a few dozen blocks, every request through the disk tier: each answer
    equals the one computed cold, nothing counts as damaged, and the engines hit each other's blocks."""
    from conftest import run_greedy

    from kvtier.config import Config
    from kvtier.engine.engine import LLMEngine
    stem = [(5 * i) % 700 + 30 for i in range(96)]
    prompts = [stem[:48 + 8 * (i % 6)] + [(13 * i + j) % 700 + 30 for j in range(20 + i)] for i in range(12)]
    cold = LLMEngine(Config(model=tiny_model_dir, block_size=16, kv_pool_tokens=64 * 16, max_batched_tokens=64,
                            prefix_cache=False, kv_host_gib=0, kv_disk=False))
    want = [run_greedy(cold, p, max_tokens=4, logprobs=None).tokens for p in prompts]
    reports = in_processes(serve_prompts, [(tiny_model_dir, str(tmp_path), prompts, seed) for seed in range(2)])
    for report in reports:
        assert report["answers"] == dict(enumerate(want))
        assert report["disk"]["errors"] == 0 and report["disk"]["damaged_removed"] == 0
    assert all(report["disk"]["hit_blocks"] > 0 for report in reports)
    assert on_disk(str(tmp_path)) <= int(0.0002 * 2**30)
