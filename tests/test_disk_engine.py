"""Disk tier through the engine: restart hits, prefixes spanning tiers, damaged files, foreign namespaces."""
import logging
import pathlib

import pytest
from conftest import max_logit_diff
from conftest import run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine

BS = 16


def make_engine(model_dir, disk_dir, **kw):
    args = dict(model=model_dir, block_size=BS, kv_pool_tokens=40 * BS, max_batched_tokens=64,
                kv_host_gib=0, kv_disk_dir=str(disk_dir), prefix_cache=False)
    return LLMEngine(Config(**{**args, **kw}))


def prompt(n, salt=0):
    return [(19 * i + salt) % 900 + 20 for i in range(n)]


def restart(engine, model_dir, disk_dir, **kw):
    engine.shutdown()
    return make_engine(model_dir, disk_dir, **kw)


def test_disk_hit_after_restart_warm_equals_cold(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150)
    cold = run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path)
    warm = run(eng, p)
    assert warm.cached == 149 and warm.tokens == cold.tokens     # all but the last token: 9 blocks and a partial one
    assert max_logit_diff(cold, warm) < 1e-4
    assert eng.tiers.disk.stats["hit_blocks"] == 10      # 9 blocks and the partial one


def test_prefix_spanning_host_and_disk(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, tmp_path, kv_host_gib=0.01)
    short, extra = prompt(70, salt=1), prompt(60, salt=2)
    run(eng, short + extra)                                  # host and disk both get 8 blocks
    eng = restart(eng, tiny_model_dir, tmp_path, kv_host_gib=0.01)
    run(eng, short)                                          # host now holds the first 4 blocks only
    tokens, _, cached = run(eng, short + extra + [7])
    host, disk = eng.tiers.host.stats, eng.tiers.disk.stats
    # 8 blocks, then 2 tokens of the partial block the first run left (its third differs)
    assert cached == 130 and host["hit_blocks"] >= 4 and disk["hit_blocks"] >= 4


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_a_miss_with_one_warning(tiny_model_dir, tmp_path, caplog, damage):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(100, salt=3)
    cold, _, _ = run(eng, p)
    eng.shutdown()
    for f in pathlib.Path(tmp_path).rglob("*.kvb"):
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            data = data[: len(data) - 5000]
        else:
            data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    eng = make_engine(tiny_model_dir, tmp_path)
    with caplog.at_level(logging.WARNING):
        tokens, _, cached = run(eng, p)
    assert tokens == cold and cached == 0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) >= 1


def test_other_dtype_never_hits(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(100, salt=4)
    run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path, dtype="bfloat16")
    _, _, cached = run(eng, p)
    assert cached == 0 and eng.tiers.disk.stats["hit_blocks"] == 0


def test_unwritable_disk_dir_degrades_to_compute(tiny_model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    eng = make_engine(tiny_model_dir, blocker / "kv")
    p = prompt(80, salt=5)
    first, _, _ = run(eng, p)
    again, _, cached = run(eng, p)
    assert again == first and cached == 0


@pytest.mark.parametrize("disk_faster", [True, False], ids=["load", "compute"])
def test_compute_or_load_takes_the_faster_path_with_the_same_tokens(tiny_model_dir, tmp_path, disk_faster):
    """Controlled rates: a disk tier measured faster than computing is loaded from, one measured slower is not;
    the tokens are the same either way."""
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=21)
    first = run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path)
    rates = eng.kv.rates
    rates.observe_prefill = rates.observe_tier = lambda *args: None      # hold the rates where the test puts them
    rates.prefill_tokens_per_s = 1000.0
    per_token = rates.bytes_per_token * rates.prefill_tokens_per_s       # computing moves this many bytes/s
    rates.tier_bytes_per_s["disk"] = per_token * (10 if disk_faster else 0.1)
    again = run(eng, p)
    assert again.tokens == first.tokens
    assert again.cached == (149 if disk_faster else 0)
    assert eng.stats()["rates"]["computed_instead"] == ({} if disk_faster else {"disk": 1})
