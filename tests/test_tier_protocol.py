"""A tier kvtier does not know, defined here (an in-memory store with a delay and failures, standing in for a
remote one), slots in below disk with one registration: saves reach it, a restarted engine restores from it,
its hits, bytes and bandwidth show in the engine's stats and /metrics, a failing one is a miss, and a stalled one
stalls no engine step."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from conftest import run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.tiers import stack
from kvtier.server.metrics import _EngineCollector

BS = 16


class MemoryTier:
    """Block payloads by key in a dict that outlives the engines (as a remote store outlives a server)."""
    name = "memory"

    def __init__(self, store: dict, delay_s: float = 0.0, failing: bool = False):
        self.store, self.delay_s, self.failing = store, delay_s, failing
        self.budget_bytes = 1 << 30
        self.stats = dict.fromkeys(("lookups", "hit_blocks", "bytes_read", "bytes_written", "evictions"), 0)
        self.misses, self.read_seconds = 0, 0.0      # its own gauges (extra_stats), which /metrics shows too

    @property
    def bytes_used(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.store.values())

    def contains(self, key: bytes) -> bool:
        return key in self.store

    def match_prefix(self, keys: list[bytes]) -> int:
        self.stats["lookups"] += 1
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        return n

    def read_run(self, keys: list[bytes], staging=None) -> list[torch.Tensor] | None:
        start = time.perf_counter()
        time.sleep(self.delay_s)
        self.read_seconds = time.perf_counter() - start
        if self.failing or not all(key in self.store for key in keys):
            self.misses += 1
            return None
        payloads = [self.store[key] for key in keys]
        self.stats["hit_blocks"] += len(keys)
        self.stats["bytes_read"] += sum(p.numel() * p.element_size() for p in payloads)
        return payloads

    def release(self, keys: list[bytes]) -> None:
        pass

    def get_run(self, keys: list[bytes], staging=None) -> list[torch.Tensor] | None:
        got = self.read_run(keys)
        return None if got is None else [p.clone() for p in got]

    def put_run(self, keys: list[bytes], payloads: list[torch.Tensor]) -> None:
        time.sleep(self.delay_s)
        for key, payload in zip(keys, payloads):
            if key not in self.store:
                self.store[key] = payload.clone()
                self.stats["bytes_written"] += payload.numel() * payload.element_size()

    def extra_stats(self) -> dict:
        return {"misses": self.misses, "read_seconds": self.read_seconds}


def engine(model_dir, disk_dir, tier: MemoryTier, monkeypatch) -> LLMEngine:
    monkeypatch.setattr(stack, "EXTRA_TIERS", [lambda config, pool: tier])     # the one registration
    return LLMEngine(Config(model=model_dir, block_size=BS, kv_pool_tokens=64 * BS, max_batched_tokens=64,
                            prefix_cache=False, kv_host_gib=0.01, kv_disk_dir=str(disk_dir)))


def prompt(n: int) -> list[int]:
    return [(7 * i) % 900 + 20 for i in range(n)]


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_a_tier_defined_outside_kvtier_serves_a_restart(tiny_model_dir, tmp_path, monkeypatch, caplog, delay_s):
    store, p = {}, prompt(200)
    first = engine(tiny_model_dir, tmp_path / "a", MemoryTier(store, delay_s), monkeypatch)
    cold = run(first, p)
    first.shutdown()
    blocks = 200 // BS + 1                    # every sealed block was saved to it, and the kept partial one
    assert len(store) == blocks
    tier = MemoryTier(store, delay_s)
    second = engine(tiny_model_dir, tmp_path / "b", tier, monkeypatch)     # a new host tier, an empty disk
    assert [t.name for t in second.tiers.tiers] == ["host", "disk", "memory"]
    with caplog.at_level(logging.INFO, logger="kvtier.engine"):
        warm = run(second, p)
    # the whole blocks (the kept partial block's index lives beside the disk tier, which is new here)
    assert warm.cached == 200 // BS * BS and warm.tokens == cold.tokens
    assert tier.stats["hit_blocks"] == 200 // BS
    assert f"{200 // BS * BS} from memory" in caplog.text                  # the per-request log line
    samples = {(family.name, tuple(sample.labels.values())): sample.value
               for family in _EngineCollector(second).collect() for sample in family.samples}
    assert samples[("kvtier_kv_tier_hit_blocks", ("memory",))] == 200 // BS
    assert samples[("kvtier_kv_tier_bytes_read", ("memory",))] > 0
    assert samples[("kvtier_kv_tier_bandwidth_bytes_per_second", ("memory",))] > 0
    assert samples[("kvtier_kv_tier_read_seconds", ("memory",))] >= delay_s           # the tier's own gauges
    assert samples[("kvtier_kv_tier_misses", ("memory",))] == 0
    second.shutdown()


def test_a_failing_tier_is_a_miss(tiny_model_dir, tmp_path, monkeypatch):
    store, p = {}, prompt(200)
    first = engine(tiny_model_dir, tmp_path / "a", MemoryTier(store), monkeypatch)
    cold = run(first, p)
    first.shutdown()
    second = engine(tiny_model_dir, tmp_path / "b", MemoryTier(store, failing=True), monkeypatch)
    warm = run(second, p)
    assert warm.cached == 0 and warm.tokens == cold.tokens
    samples = {(family.name, tuple(sample.labels.values())): sample.value
               for family in _EngineCollector(second).collect() for sample in family.samples}
    assert samples[("kvtier_kv_tier_misses", ("memory",))] >= 1
    second.shutdown()


class StalledTier(MemoryTier):
    """Reads and writes wait until the gate opens (at most 30 s: a test that fails does not hang)."""

    def __init__(self, store: dict):
        super().__init__(store)
        self.gate = threading.Event()
        self.stalled = 0         # calls waiting at the gate now

    def _wait(self) -> None:
        self.stalled += 1
        self.gate.wait(30)
        self.stalled -= 1

    def read_run(self, keys, staging=None):
        self._wait()
        return super().read_run(keys, staging)

    def put_run(self, keys, payloads):
        self._wait()
        super().put_run(keys, payloads)


def test_a_stalled_tier_stalls_no_engine_step(tiny_model_dir, tmp_path, monkeypatch):
    """While the tier's reads and writes hang, the engine thread goes on: a decoding request finishes while a save
    to the tier and a restore from it are both still waiting; once the tier answers, the restore lands."""
    store = {}
    history = prompt(200)
    first = engine(tiny_model_dir, tmp_path / "a", MemoryTier(store), monkeypatch)
    run(first, history)
    first.shutdown()
    tier = StalledTier(store)
    eng = engine(tiny_model_dir, tmp_path / "b", tier, monkeypatch)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng.add_request("decoding", prompt(40)[::-1], params)
    eng.add_request("restoring", history + [5, 6, 7], params)
    done, start = {}, time.monotonic()
    while "decoding" not in done and time.monotonic() - start < 60:
        done.update((out.request_id, out) for out in eng.step() if out.finished)
    assert "decoding" in done and tier.stalled >= 2 and "restoring" not in done   # a save and a restore wait
    tier.gate.set()
    while eng.has_unfinished():
        done.update((out.request_id, out) for out in eng.step() if out.finished)
    assert done["restoring"].num_cached_tokens == 200 // BS * BS
    eng.shutdown()


def test_a_tier_that_raises_on_save_loses_the_run_not_the_saver(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A lower tier whose write raises (a remote store gone away): the saves still land, the pool empties, and
    the next request's saves land too."""
    tier = MemoryTier({})

    def gone(keys, payloads):
        raise ConnectionError("the store went away")
    tier.put_run = gone
    eng = engine(tiny_model_dir, tmp_path, tier, monkeypatch)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, salt in enumerate((1, 2)):
        eng.add_request(f"r{i}", [t + salt for t in prompt(100)], params)
        deadline = time.monotonic() + 60
        while eng.has_unfinished() and time.monotonic() < deadline:
            eng.step()
        assert not eng.has_unfinished() and eng.kv.num_saving == 0
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    assert "the memory tier failed to save" in caplog.text
    eng.shutdown()
