"""Host RAM tier: saves in the background, restores after device eviction, warm equals cold."""
import random
import threading
import time

import pytest
import torch
from conftest import max_logit_diff
from conftest import run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.sequence import SequenceStatus
from kvtier.kv.keys import chain_keys
from kvtier.kv.tiers.host import HostTier

BS = 16


def make_engine(tiny_model_dir, **kw):
    args = dict(model=tiny_model_dir, block_size=BS, kv_pool_tokens=24 * BS, max_batched_tokens=64,
                kv_host_gib=0.01, kv_disk=False)
    return LLMEngine(Config(**{**args, **kw}))


def settle(engine, timeout: float = 30.0):
    """Wait until background saves have landed and their blocks are unpinned (fails after timeout)."""
    deadline = time.monotonic() + timeout
    while not engine.kv.idle():
        if time.monotonic() > deadline:
            pytest.fail(f"background transfers did not land within {timeout} s")
        time.sleep(0.001)
    engine.step()


def prompt(n, salt=0):
    return [(17 * i + salt) % 900 + 20 for i in range(n)]


def test_host_tier_lru_budget():
    import torch
    tier = HostTier(3 * 64 + 10, (16,), torch.float32)
    for i in range(5):
        tier.put(bytes([i]) * 16, torch.zeros(16))        # 64 bytes each
    assert len(tier) == 3 and tier.bytes_used == 192 and tier.stats["evictions"] == 2
    assert tier.match_prefix([bytes([2]) * 16, bytes([3]) * 16, bytes([0]) * 16]) == 2
    assert tier.get_run([bytes([0]) * 16]) is None


def test_concurrent_writers_keep_every_slot_and_payload():
    """Writers copy outside the lock: racing puts of the same keys keep one slot each, no slot leaks, and every
    held block holds its payload."""
    tier = HostTier(budget_bytes=24 * 64, block_shape=(4, 4), dtype=torch.float32)       # 24 slots of 64 bytes
    keys = [bytes([i]) * 16 for i in range(40)]

    def writer(seed):
        for i in random.Random(seed).sample(range(40), 40):
            tier.put(keys[i], torch.full((4, 4), float(i)), pin=i < 8)
    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tier) + len(tier._free_slots) == tier.num_slots
    assert len(set(tier._slots.values())) == len(tier)
    assert all(keys[i] in tier._slots for i in range(8))                  # pinned: never evicted
    for key, slot in tier._slots.items():
        assert torch.equal(tier.slab[slot], torch.full((4, 4), float(key[0])))


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["after-eviction", "pure-tier"])
def test_host_hit_warm_equals_cold(tiny_model_dir, prefix_cache):
    eng = make_engine(tiny_model_dir, prefix_cache=prefix_cache)
    p = prompt(150)
    cold = run(eng, p)
    settle(eng)
    assert len(eng.tiers.host) >= 150 // BS
    if prefix_cache:
        for salt in range(1, 6):                        # push p's blocks out of the device pool
            run(eng, prompt(300, salt=salt))
            settle(eng)
        assert chain_keys(p, BS, eng.pool.namespace)[0] not in eng.pool.cached   # gone from the device
    warm = run(eng, p)
    assert cold.cached == 0 and warm.cached == 149       # all but the last token: 9 blocks and a partial one
    assert warm.tokens == cold.tokens
    assert max_logit_diff(cold, warm) < 1e-4
    assert eng.tiers.host.stats["hit_blocks"] >= 9
    settle(eng)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_pure_tier_mode_never_reuses_device_blocks(tiny_model_dir):
    eng = make_engine(tiny_model_dir, prefix_cache=False)
    p = prompt(100, salt=9)
    run(eng, p)
    settle(eng)
    assert eng.pool.num_cached_blocks == 0
    _, _, cached = run(eng, p)
    assert cached == 99 and eng.tiers.host.stats["hit_blocks"] == 7     # 6 blocks and the partial one


def steps_until_finished(eng, request_id: str, timeout: float = 60.0) -> list:
    outs, deadline = [], time.monotonic() + timeout
    while not any(o.request_id == request_id and o.finished for o in outs):
        assert time.monotonic() < deadline, f"{request_id} did not finish"
        outs += eng.step()
    return outs


def test_a_prefix_still_being_saved_is_shared_not_computed(tiny_model_dir):
    """Pure host-tier mode, the next turn sent the moment the last one answered (an agent's tool loop): the
    blocks the first request sealed are still being saved, and the next request shares the device blocks the
    saves hold, neither computing them again nor waiting for the saves (which here never land before it ends)."""
    eng = make_engine(tiny_model_dir, prefix_cache=False)
    p = prompt(150, salt=23)
    host, gate = eng.tiers.host, threading.Event()
    put_run = host.put_run
    host.put_run = lambda *args: gate.wait(30) and put_run(*args)      # every save stays in flight
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    eng.add_request("first", p, params)
    steps_until_finished(eng, "first")
    assert len(host) == 0                                              # nothing has landed yet
    eng.add_request("next", p + prompt(40, salt=5), params)
    last = [o for o in steps_until_finished(eng, "next") if o.request_id == "next"][-1]
    assert last.num_cached_tokens >= 150 // BS * BS and len(host) == 0     # the saves are still held
    gate.set()
    settle(eng)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_engine_keeps_stepping_while_a_prefix_loads(tiny_model_dir):
    eng = make_engine(tiny_model_dir, prefix_cache=False)
    p = prompt(120, salt=11)
    run(eng, p)
    settle(eng)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("other", prompt(20, salt=12), params)
    eng.step()                                       # "other" is running
    eng.kv.mover._loads.put(None)                    # stall the loader: the load stays in flight
    eng.kv.mover._threads[1].join()
    eng.add_request("warm", p, params)
    finished = []
    for _ in range(10):
        finished += [o.request_id for o in eng.step() if o.finished]
    assert "other" in finished
    assert eng.kv.loading["warm"].loading and eng.scheduler.find("warm").status is SequenceStatus.WAITING


def test_cancel_during_load_frees_blocks_after_the_copy(tiny_model_dir):
    eng = make_engine(tiny_model_dir, prefix_cache=False)
    p = prompt(120, salt=13)
    run(eng, p)
    settle(eng)
    gate, read = threading.Event(), eng.kv.mover._read
    eng.kv.mover._read = lambda *args, **kw: gate.wait(30) and read(*args, **kw)    # the copy stays in flight
    eng.add_request("c", p, SamplingParams(max_tokens=4))
    eng.step()
    assert "c" in eng.kv.loading
    reserved = list(eng.kv.loading["c"].block_table)
    eng.abort_request("c")
    outs = eng.step()                 # the abort is taken while the copy is still in flight
    assert all(eng.pool.ref_counts[b] > 0 for b in reserved)   # so its blocks are not freed yet
    gate.set()
    deadline = time.monotonic() + 30
    while eng.has_unfinished() and time.monotonic() < deadline:
        outs += eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("c", "abort")]
    settle(eng)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
