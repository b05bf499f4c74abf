"""Disk tier through the engine: restart hits, prefixes spanning tiers, damaged files, foreign namespaces, the
measured rates a restart keeps."""
import json
import logging
import pathlib
import time

import pytest
import torch
from conftest import max_logit_diff
from conftest import run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.rates import rates_path

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


@pytest.mark.parametrize("quantize", ["none", "int4"], ids=["eager", "ggml-decode"])
def test_a_float16_cache_restored_after_a_restart_equals_cold(tiny_model_dir, tmp_path, quantize):
    """--kv-cache-dtype float16: blocks of half a float32 cache's bytes, in the pool and on disk; a restart's
    restore gives what a cold run computes; and a float32 pool of the same model keys its blocks in another
    namespace, so it finds none of them."""
    half_cache = dict(kv_cache_dtype="float16", quantize=quantize, device="cpu")   # a CPU option only
    eng = make_engine(tiny_model_dir, tmp_path, **half_cache)
    p = prompt(150)
    cold = run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path, **half_cache)
    warm = run(eng, p)
    assert warm.cached == 149 and warm.tokens == cold.tokens
    assert max_logit_diff(cold, warm) < 1e-4
    half, namespace = eng.pool.block_bytes, eng.pool.namespace
    assert eng.tiers.disk.block_bytes == half and eng.pool.dtype == torch.float16
    eng = restart(eng, tiny_model_dir, tmp_path, quantize=quantize, device="cpu")
    assert eng.pool.block_bytes == 2 * half and eng.pool.namespace != namespace
    assert run(eng, p).cached == 0


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


def hold_rates(eng, disk_speed):
    """Hold the rates where the test puts them: computing at 1000 tokens/s, the disk `disk_speed` times as fast."""
    rates = eng.kv.rates
    rates.observe_prefill = rates.observe_tier = lambda *args: None
    rates.prefill_tokens_per_s = 1000.0
    rates.tier_bytes_per_s["disk"] = rates.bytes_per_token * rates.prefill_tokens_per_s * disk_speed


# 150 tokens: 9 full blocks and a partial one below the device. At the same speed as computing, the front 4 are
# computed while the other 5 and the partial one load (5 blocks' time either way); at 0.1× even the last block
# loads slower than computing all 9, and the partial one is computed with them: 149 cached tokens, loaded or
# computed instead, every way.
@pytest.mark.parametrize("disk_speed, cached, computed", [(10, 149, {}), (1, 149 - 4 * BS, {"disk": 4 * BS}),
                                                          (0.1, 0, {"disk": 149})], ids=["load", "both", "compute"])
def test_compute_or_load_takes_the_faster_path_with_the_same_tokens(tiny_model_dir, tmp_path, disk_speed, cached,
                                                                     computed):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=21)
    first = run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path)
    hold_rates(eng, disk_speed)
    again = run(eng, p)
    assert again.tokens == first.tokens and max_logit_diff(first, again) < 1e-4
    assert again.cached == cached
    assert eng.stats()["rates"]["computed_instead"] == computed
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def stall_disk(eng, seconds):
    disk = eng.tiers.disk
    read = disk.read_run
    disk.read_run = lambda keys, staging=None: (time.sleep(seconds), read(keys, staging))[1]


def test_the_front_is_computed_while_the_back_loads(tiny_model_dir, tmp_path):
    """A request computing its front runs beside its load, waits at the loaded blocks until they land, then goes
    on after them."""
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=22)
    first = run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path)
    hold_rates(eng, 1)
    stall_disk(eng, 0.5)
    eng.add_request("r", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    computed_while_loading, tokens = 0, []
    while eng.kv.loading or not computed_while_loading:
        tokens += [t for out in eng.step() for t in out.new_token_ids]
        seq = eng.scheduler.find("r")
        if eng.kv.loading:
            computed_while_loading = seq.num_computed_tokens
            assert seq.num_computed_tokens <= seq.kv.load_from      # never past the blocks still loading
    assert computed_while_loading == 4 * BS
    while eng.has_unfinished():
        tokens += [t for out in eng.step() for t in out.new_token_ids]
    assert tokens == first.tokens


def test_a_missed_load_while_computing_the_front_computes_the_rest(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=23)
    first = run(eng, p)
    eng.shutdown()
    for f in pathlib.Path(tmp_path).rglob("*.kvb"):      # every block's payload damaged: the load of the back misses
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    eng = make_engine(tiny_model_dir, tmp_path)
    hold_rates(eng, 1)
    again = run(eng, p)
    assert again.tokens == first.tokens and again.cached == 0
    assert eng.stats()["rates"]["computed_instead"] == {"disk": 4 * BS}
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_abort_while_computing_the_front_frees_the_blocks_once_the_copy_lands(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=24)
    run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path)
    hold_rates(eng, 1)
    stall_disk(eng, 0.5)
    eng.add_request("r", p, SamplingParams(max_tokens=6))
    eng.step()
    assert eng.scheduler.find("r").num_computed_tokens == 4 * BS and eng.kv.loading
    eng.abort_request("r")
    eng.step()
    reserved = eng.kv.loading["r"].block_table
    assert all(eng.pool.ref_counts[b] > 0 for b in reserved)     # the copy is in flight: nothing freed yet
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "abort")]
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def saved_rates(eng, disk_speed):
    """Rates as a server that measured them would leave them: computing at 1000 tokens/s, the disk `disk_speed`
    times as fast; written at shutdown."""
    rates = eng.kv.rates
    rates.prefill_tokens_per_s = 1000.0
    rates.tier_bytes_per_s["disk"] = rates.bytes_per_token * rates.prefill_tokens_per_s * disk_speed
    eng.shutdown()
    return rates.stats()


def test_a_restarted_server_weighs_loading_with_the_rates_it_measured_before(tiny_model_dir, tmp_path):
    """Without its rates a new server loads every prefix; with the ones saved at shutdown it computes a prefix
    the disk is too slow for, from its first request, with the same tokens."""
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=25)
    first = run(eng, p)
    saved = saved_rates(eng, disk_speed=0.1)
    eng = make_engine(tiny_model_dir, tmp_path)
    rates = eng.stats()["rates"]
    assert rates["prefill_tokens_per_s"] == saved["prefill_tokens_per_s"]
    assert rates["tier_bytes_per_s"] == saved["tier_bytes_per_s"]
    again = run(eng, p)
    assert again.tokens == first.tokens and again.cached == 0
    assert eng.stats()["rates"]["computed_instead"] == {"disk": 149}     # 9 full blocks and the partial one


def test_a_server_killed_while_serving_keeps_the_rates_it_measured(tiny_model_dir, tmp_path):
    """Rates are written while serving (here at once; by default at most once a minute), off the engine thread,
    so a server that never shuts down (killed) leaves them for the next one; unchanged rates are not rewritten."""
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=27)
    run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path)
    assert not list(pathlib.Path(tmp_path).rglob("rates/*.json"))     # nothing measured yet: nothing written
    eng.kv.rates.save_every_s = 0
    assert run(eng, p).cached == 149                                  # a load from disk measures the disk
    while not eng.kv.idle():
        time.sleep(0.01)
    measured = eng.stats()["rates"]["tier_bytes_per_s"]
    assert set(measured) == {"disk"}
    assert eng.kv.rates.pending() is None                             # taken: the same rates are not written again
    # no shutdown: the next server takes up what the killed one measured
    assert make_engine(tiny_model_dir, tmp_path).stats()["rates"]["tier_bytes_per_s"] == measured


def test_the_read_buffer_is_carved_once_from_the_host_budget(tiny_model_dir, tmp_path):
    """The buffer a restore from disk reads into is carved from the host tier's slab at start-up (so --kv-host-gib
    covers it, pinned on CUDA, faulted in before serving) and never grown: a restore after a restart reads into it.
    Without a host tier the disk tier gets a buffer of its own, allocated once the same way."""
    eng = make_engine(tiny_model_dir, tmp_path, kv_host_gib=0.01)
    p = prompt(150, salt=28)
    run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path, kv_host_gib=0.01)
    host, buffer = eng.tiers.host, eng.tiers.staging.buffer
    assert buffer.numel() >= eng.pool.blocks_for(eng.max_model_len) * eng.pool.block_bytes    # a whole context
    assert host.block_budget_bytes + buffer.numel() == host.budget_bytes
    assert buffer.untyped_storage().data_ptr() == host.slab.untyped_storage().data_ptr()
    disk, landed = eng.tiers.disk, []
    read = disk.read_run
    disk.read_run = lambda keys, staging=None: (landed.append(got := read(keys, staging)), got)[1]
    assert run(eng, p).cached == 149
    assert landed and all(block.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                          for block in landed[0])
    assert eng.tiers.staging.buffer is buffer
    eng.shutdown()
    alone = make_engine(tiny_model_dir, tmp_path)          # no host tier: the disk reads into a buffer of its own
    assert alone.tiers.staging.buffer.numel() == alone.pool.blocks_for(alone.max_model_len) * alone.pool.block_bytes


@pytest.mark.parametrize("damage", ["garbage", "negative", "other model"])
def test_damaged_saved_rates_are_ignored(tiny_model_dir, tmp_path, caplog, damage):
    eng = make_engine(tiny_model_dir, tmp_path)
    p = prompt(150, salt=26)
    first = run(eng, p)
    saved_rates(eng, disk_speed=0.1)
    [path] = pathlib.Path(tmp_path, "rates").glob("*.json")
    record = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "negative":
        path.write_text(json.dumps({**record, "prefill_tokens_per_s": -5.0}))
    else:
        path.write_text(json.dumps({**record, "bytes_per_token": record["bytes_per_token"] * 2}))
    with caplog.at_level(logging.WARNING):
        eng = make_engine(tiny_model_dir, tmp_path)
    assert any("ignoring the saved rates" in r.getMessage() for r in caplog.records)
    assert eng.stats()["rates"]["prefill_tokens_per_s"] is None and eng.stats()["rates"]["tier_bytes_per_s"] == {}
    again = run(eng, p)                   # unmeasured: the prefix loads
    assert again.tokens == first.tokens and again.cached == 149


def test_saved_rates_belong_to_the_device_they_were_measured_on(tmp_path):
    threads = torch.get_num_threads()
    try:
        paths = set()
        for n in (1, 2):
            torch.set_num_threads(n)
            paths.add(rates_path(str(tmp_path), b"n" * 16, torch.device("cpu")))
    finally:
        torch.set_num_threads(threads)
    assert len(paths) == 2


def test_warm_up_leaves_nothing_behind_and_changes_no_answer(tiny_model_dir, tmp_path):
    """A restarted engine that warms up (as `kvtier serve` does before it is ready): no block is sealed, cached,
    held or written to a tier, the disk staging buffer is faulted in for a whole-context restore, and the first
    request restores and answers exactly as on an engine that did not warm up."""
    from kvtier.engine.warmup import warm_up
    eng = make_engine(tiny_model_dir, tmp_path, kv_host_gib=0.01)
    p = prompt(150)
    cold = run(eng, p)
    eng = restart(eng, tiny_model_dir, tmp_path, kv_host_gib=0.01)
    written = eng.tiers.disk.stats["bytes_written"]
    eng.tiers.staging.buffer.fill_(255)
    assert warm_up(eng) > 0
    pool = eng.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.num_cached_blocks == 0 and not eng.has_unfinished()
    assert eng.tiers.disk.stats["bytes_written"] == written
    assert not eng.tiers.staging.buffer.any()         # every page written: faulted in
    warm = run(eng, p)
    assert warm.cached == 149 and warm.tokens == cold.tokens
    assert max_logit_diff(cold, warm) < 1e-4
