"""A turn continues from the previous turn's last, partly filled block: a copy of it, from the device
pool or any tier, so only the new tokens are computed; the published block never changes."""
import pytest
import torch
from conftest import max_logit_diff
from conftest import run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.kv.keys import block_key, chain_keys

BS = 16
TIERS = {
    "device": dict(prefix_cache=True, kv_host_gib=0, kv_disk=False),
    "host": dict(prefix_cache=False, kv_host_gib=0.01, kv_disk=False),
    "disk": dict(prefix_cache=False, kv_host_gib=0, kv_disk=True),
}


def make_engine(tiny_model_dir, tmp_path, **kw):
    args = dict(model=tiny_model_dir, block_size=BS, kv_pool_tokens=40 * BS, max_batched_tokens=64,
                kv_disk_dir=str(tmp_path / "kv"))
    return LLMEngine(Config(**{**args, **kw}))


def prompt(n, salt=0):
    return [(13 * i + salt) % 800 + 30 for i in range(n)]


@pytest.fixture(scope="module")
def cold_engine(tiny_model_dir, tmp_path_factory):
    return make_engine(tiny_model_dir, tmp_path_factory.mktemp("cold"), prefix_cache=False, kv_host_gib=0,
                       kv_disk=False)


@pytest.mark.parametrize("tier", TIERS)
def test_next_turn_computes_only_its_new_tokens(tiny_model_dir, tmp_path, cold_engine, tier):
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS[tier])
    first = prompt(150)
    answer = run(eng, first, max_tokens=6).tokens       # 155 tokens computed: 9 full blocks and 11 more
    if tier == "disk":                                  # a restart: only the disk remains
        eng.shutdown()
        eng = make_engine(tiny_model_dir, tmp_path, **TIERS[tier])
    nxt = first + answer + prompt(20, salt=5)
    warm = run(eng, nxt)
    cold = run(cold_engine, nxt)
    assert warm.cached == 155 and cold.cached == 0
    assert warm.tokens == cold.tokens and max_logit_diff(cold, warm) < 1e-4


@pytest.mark.parametrize("tier", TIERS)
def test_a_prompt_sent_again_after_its_answer_filled_its_last_block_computes_only_its_last_token(
        tiny_model_dir, tmp_path, cold_engine, tier):
    """A retry, a regenerated answer, a branch inside the prompt's last block: that block was sealed whole once the
    answer filled it, and is found by the tokens the prompt ends with, from the device or any tier, after a
    restart too."""
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS[tier])
    first = prompt(150, salt=6)
    run(eng, first, max_tokens=40)       # 189 tokens: the prompt ends in the 10th block, the 11th filled too
    if tier == "disk":
        eng.shutdown()
        eng = make_engine(tiny_model_dir, tmp_path, **TIERS[tier])
    for again, shared in ((first, 149), (first[:147] + prompt(10, salt=9), 147)):
        warm, cold = run(eng, again), run(cold_engine, again)
        assert warm.cached == shared and cold.cached == 0
        assert warm.tokens == cold.tokens and max_logit_diff(cold, warm) < 1e-4


def test_a_prompt_diverging_inside_the_partial_block_reuses_what_it_shares(tiny_model_dir, tmp_path, cold_engine):
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS["device"])
    first = prompt(150)
    answer = run(eng, first, max_tokens=6).tokens
    nxt = first + answer[:3] + prompt(20, salt=7)     # shares 153 tokens: 9 blocks and 9 of the partial's 11
    warm, cold = run(eng, nxt), run(cold_engine, nxt)
    assert warm.cached == 153
    assert warm.tokens == cold.tokens and max_logit_diff(cold, warm) < 1e-4


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_prompt_diverging_inside_the_last_full_block_reuses_what_it_shares(tiny_model_dir, tmp_path, cold_engine,
                                                                             tier):
    """The usual next turn of a chat: the earlier prompt ended in a generation prompt the new one replaces."""
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS[tier])
    first = prompt(160, salt=4)                     # 10 full blocks computed, nothing after them
    run(eng, first, max_tokens=1)
    nxt = first[:157] + prompt(20, salt=8)
    warm, cold = run(eng, nxt), run(cold_engine, nxt)
    assert warm.cached == 157                       # 9 blocks, then 13 of the 10th block's 16 tokens
    assert warm.tokens == cold.tokens and max_logit_diff(cold, warm) < 1e-4


def test_the_published_partial_block_never_changes(tiny_model_dir, tmp_path):
    """Two turns continue it, each writing its own tokens after the shared ones: what its key names stays bitwise
    the same, wherever it lies (the first turn takes the block where it follows the prefix, its copy published
    instead: that turn's context stays in consecutive blocks)."""
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS["device"])
    first = prompt(150, salt=3)
    answer = run(eng, first, max_tokens=6).tokens
    computed = (first + answer)[:155]
    full = chain_keys(computed, BS, eng.pool.namespace)
    key = block_key(full[-1], computed[144:], eng.pool.namespace)
    before = eng.pool.read_block(eng.pool.cached[key])
    for salt in (11, 12):
        turn = first + answer + prompt(30, salt=salt)
        assert run(eng, turn).cached == 155
        tenth = chain_keys(turn, BS, eng.pool.namespace)[9]        # the block after the 9 shared full ones
        assert salt == 12 or eng.pool.cached[tenth] == eng.pool.cached[full[-1]] + 1
    # bitwise: the slots after the 11 written tokens hold whatever the pool's memory held, NaN patterns included
    after = eng.pool.read_block(eng.pool.cached[key])
    assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))


def test_a_damaged_partial_entry_is_a_miss(tiny_model_dir, tmp_path, cold_engine):
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS["disk"])
    first = prompt(150, salt=9)
    answer = run(eng, first, max_tokens=6).tokens
    eng.shutdown()
    entries = list((tmp_path / "kv" / "partials").glob("*.kvp"))     # the partial block and the last full one
    assert len(entries) == 2
    for entry in entries:
        entry.write_text(entry.read_text().replace('"tokens": [', '"tokens": [1, '))
    eng = make_engine(tiny_model_dir, tmp_path, **TIERS["disk"])
    nxt = first + answer + prompt(20, salt=5)
    warm, cold = run(eng, nxt), run(cold_engine, nxt)
    assert warm.cached == 144 and warm.tokens == cold.tokens
    assert not any(entry.exists() for entry in entries)
