"""Device prefix cache: content keys, reuse, eviction, warm equals cold."""
import pytest
import torch
from conftest import max_logit_diff
from conftest import run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.keys import block_key, chain_keys, namespace

BS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=40 * BS, max_batched_tokens=64,
                                kv_host_gib=0, kv_disk=False))


def prompt(n, salt=0):
    return [(13 * i + salt) % 900 + 20 for i in range(n)]


def test_keys_are_stable_chained_and_namespaced():
    ns = namespace("weights-a", "float32", 16, "layout")
    assert block_key(None, [1, 2, 3], ns) == block_key(None, [1, 2, 3], ns)
    assert block_key(None, [1, 2, 3], ns) != block_key(None, [1, 2, 4], ns)
    keys = chain_keys(list(range(40)), 16, ns)
    assert len(keys) == 2 and keys[1] == block_key(keys[0], list(range(16, 32)), ns)
    # the same tokens after a different first block get a different key
    assert chain_keys([9] + list(range(1, 32)), 16, ns)[1] != keys[1]
    for other in (namespace("weights-b", "float32", 16, "layout"), namespace("weights-a", "bfloat16", 16, "layout"),
                  namespace("weights-a", "float32", 32, "layout"), namespace("weights-a", "float32", 16, "other"),
                  namespace("weights-a", "float32", 16, "layout", attention="bounded(512)")):
        assert chain_keys(list(range(40)), 16, other)[0] != keys[0]


def test_device_hit_warm_equals_cold(engine):
    p = prompt(100)
    cold = run(engine, p)
    warm = run(engine, p)
    assert cold.cached == 0 and warm.cached == 99       # 6 full blocks and 3 tokens of the partial one; the last
                                                        # token is always computed
    assert warm.tokens == cold.tokens
    assert max_logit_diff(cold, warm) < 1e-4


def test_partial_hit_and_generated_tokens_are_reusable(engine):
    base = prompt(70, salt=1)
    tokens, _, _ = run(engine, base, max_tokens=30)
    # a follow-up turn: the earlier prompt, its answer, and a new message
    follow = base + tokens + prompt(20, salt=2)
    _, _, cached = run(engine, follow)
    assert cached == len(base) + len(tokens) - 1    # the answer's blocks were kept too, the partial last one with them
    diverged = base[:40] + prompt(30, salt=3)
    _, _, cached = run(engine, diverged)
    assert cached == 32


def test_concurrent_requests_share_prefix_blocks(engine):
    shared = prompt(64, salt=4)
    run(engine, shared + [5])                     # warm the shared prefix
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"c{i}", shared + prompt(10, salt=10 + i), params)
    engine.step()
    tables = [s.kv.block_table for s in engine.scheduler.running]
    assert len(tables) == 3 and tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert all(engine.pool.ref_counts[b] == 3 for b in tables[0][:4])
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_shared_blocks_are_never_written(engine):
    shared = prompt(48, salt=5)
    run(engine, shared + [1, 2])
    blocks = [engine.pool.cached[k] for k in chain_keys(shared, BS, engine.pool.namespace)]
    slots = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in blocks])
    before = engine.pool.slots_kv(slots)
    run(engine, shared + prompt(40, salt=6), max_tokens=20)
    assert torch.equal(engine.pool.slots_kv(slots), before)


def test_lru_eviction_under_pool_pressure(engine):
    p = prompt(80, salt=7)
    run(engine, p)
    for salt in range(20, 30):                      # other prompts push p's blocks out of the pool
        run(engine, prompt(120, salt=salt))
    _, _, cached = run(engine, p)
    assert cached == 0
    assert engine.pool.num_cached_blocks <= engine.pool.num_blocks


def test_no_prefix_cache_never_reuses(tiny_model_dir):
    eng = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=40 * BS, prefix_cache=False,
                           kv_host_gib=0, kv_disk=False))
    p = prompt(100, salt=8)
    first, _, _ = run(eng, p)
    again, _, cached = run(eng, p)
    assert cached == 0 and again == first and eng.pool.num_cached_blocks == 0


def test_dtype_change_never_hits(tiny_model_dir, engine):
    other = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=40 * BS, dtype="bfloat16"))
    assert other.pool.namespace != engine.pool.namespace
