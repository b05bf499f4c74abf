"""The mover: byte-exact copies both ways (on CUDA through its copy stream), decode that keeps its pace while
a slow tier loads, and a cancel that waits for the copy in flight."""
import statistics
import time

import pytest
import torch
from conftest import fill_random, run_greedy as run

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.keys import chain_keys
from kvtier.kv.pool import KVPool
from kvtier.kv.tiers.host import HostTier
from kvtier.kv.tiers.mover import LoadJob, Mover
from kvtier.kv.tiers.stack import TierStack

BS = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def wait_for(mover: Mover, count: int):
    events, deadline = [], time.monotonic() + 30
    while len(events) < count and time.monotonic() < deadline:
        mover.wait(0.05)
        polled = mover.poll()
        events += [blocks for _, blocks in polled.saved] + polled.loaded
    assert len(events) == count
    return events


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_run_saved_and_restored_through_the_mover_is_byte_exact(device, staged, monkeypatch):
    """Staged is CUDA's way (a gather or scatter through a contiguous buffer), here run on CPU too, in groups
    of two blocks."""
    pool = KVPool(3, 2, 8, BS, 16 * BS, torch.float32, torch.device(device))
    pool.staged_copies = staged
    monkeypatch.setattr("kvtier.kv.pool.STAGE_BYTES", 2 * pool.block_bytes)
    assert_round_trip(pool)


def test_a_transposed_pools_run_saved_and_restored_through_the_mover_is_byte_exact():
    """ggml's CPU pool (each layer's V transposed) copies its blocks through each mover thread's own memory."""
    assert_round_trip(KVPool(3, 2, 8, BS, 16 * BS, torch.float32, torch.device("cpu"), values_transposed=True))


def assert_round_trip(pool: KVPool) -> None:
    """Five blocks saved into the host tier through a mover and restored into others come back byte for byte."""
    fill_random(pool, 0)
    host = HostTier(8 * pool.block_bytes, pool.block_shape, torch.float32, pin_memory=pool.device.type == "cuda")
    mover = Mover(pool, TierStack([host]))
    keys = chain_keys(list(range(5 * BS)), BS, b"ns")
    before = [pool.read_block(b) for b in (2, 3, 5, 7, 11)]
    assert len({tuple(b.flatten()[:8].tolist()) for b in before}) == 5      # blocks that differ: none stands in
    mover.save(keys, [2, 3, 5, 7, 11])
    wait_for(mover, 1)
    job = LoadJob("r", keys, [12, 13, 14, 15, 0])
    mover.load(job)
    (landed,) = wait_for(mover, 1)
    assert landed.ok and landed.bytes == 5 * pool.block_bytes
    assert all(torch.equal(pool.read_block(b), want) for b, want in zip([12, 13, 14, 15, 0], before))
    mover.shutdown()


def test_staged_payloads_leave_the_device_contiguous(monkeypatch):
    """CUDA's staged copy-out, here on CPU: each block's payload is one contiguous piece (one DMA to host memory),
    equal to the block's strided slots."""
    pool = KVPool(3, 2, 8, BS, 16 * BS, torch.float32, torch.device("cpu"))
    pool.staged_copies = True
    monkeypatch.setattr("kvtier.kv.pool.STAGE_BYTES", 2 * pool.block_bytes)
    fill_random(pool, 0)
    blocks = [4, 1, 9]
    payloads = list(pool.blocks_out(blocks))
    assert all(p.is_contiguous() for p in payloads)
    assert all(torch.equal(p, pool.read_block(b)) for p, b in zip(payloads, blocks))


def test_a_pool_keeping_v_transposed_moves_payloads_of_its_own_layout():
    """ggml's CPU pool (each layer's V transposed) hands the tiers its K as a pool keeping K and V alike does and its
    V as it keeps it (`payload_kv` reads both as the same K/V), under a layout its namespace names, takes them back,
    and copies blocks within itself."""
    plain, transposed = (KVPool(3, 2, 8, BS, 16 * BS, torch.float32, torch.device("cpu"), values_transposed=t)
                         for t in (False, True))
    fill_random(plain, 0)
    for mine, theirs in zip(transposed.caches, plain.caches):      # the transposed pool has slots past the blocks'
        mine[:, :theirs.shape[1]].copy_(theirs)
    assert transposed.v_cache[0].permute(1, 2, 0).is_contiguous()
    assert transposed.block_shape == plain.block_shape and transposed.block_bytes == plain.block_bytes
    assert KVPool.layout(True) != KVPool.layout(False)
    blocks = [4, 1, 9]
    for mine, theirs in zip(transposed.read_blocks(blocks), plain.read_blocks(blocks)):
        assert torch.equal(mine[0], theirs[0]) and not torch.equal(mine[1], theirs[1])
        assert all(torch.equal(a, b) for a, b in zip(transposed.payload_kv(mine), plain.payload_kv(theirs)))
    assert all(torch.equal(a, b) for a, b in zip(transposed.blocks_out(blocks), transposed.read_blocks(blocks)))
    payloads = list(transposed.read_blocks([2, 3]))
    transposed.blocks_in([7, 8], payloads)
    transposed.copy_block(7, 11)
    assert torch.equal(transposed.read_blocks([7, 8, 11]), torch.stack([*payloads, payloads[0]]))
    assert all(torch.equal(a, b) for a, b in zip(transposed.block_kv(7), plain.block_kv(2)))


@pytest.mark.parametrize("transposed", [False, True], ids=["plain", "transposed"])
def test_paged_out_blocks_gathered_from_the_host_tier_are_their_kv(transposed):
    """A bounded chunk's paged-out blocks, laid out from their host-tier payloads for eager attention, are their
    K/V in either pool layout (`KVPool.payload_kv`)."""
    pool = KVPool(3, 2, 8, BS, 16 * BS, torch.float32, torch.device("cpu"), values_transposed=transposed)
    fill_random(pool, 0)
    host = HostTier(8 * pool.block_bytes, pool.block_shape, torch.float32, pin_memory=False)
    mover = Mover(pool, TierStack([host]))
    keys, blocks = chain_keys(list(range(3 * BS)), BS, b"ns"), [5, 2, 9]
    for key, payload in zip(keys, pool.read_blocks(blocks)):
        assert host.put(key, payload, pin=True)
    gathered, empty = mover.gather([keys, []], {})
    slots = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in blocks])
    assert empty is None and torch.equal(gathered, pool.slots_kv(slots))
    mover.shutdown()


def stall(engine: LLMEngine, seconds: float) -> None:
    """Slow every read of the host tier down: a stalled tier."""
    host = engine.tiers.host
    read = host.read_run
    host.read_run = lambda keys, staging=None: (time.sleep(seconds), read(keys, staging))[1]


def test_decode_keeps_its_pace_while_a_stalled_tier_loads(tiny_model_dir):
    eng = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=64 * BS, max_batched_tokens=256,
                           kv_host_gib=0.01, kv_disk=False, prefix_cache=False))
    history = [(7 * i) % 800 + 40 for i in range(400)]
    run(eng, history, max_tokens=1)                  # its blocks land in the host tier
    eng.add_request("stream", [5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
    eng.step()                                       # prefilled: decoding from here on

    def timed_steps(n):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - start)
        return times
    alone = timed_steps(20)
    stall(eng, 1.5)
    eng.add_request("warm", history + [9], SamplingParams(max_tokens=1))
    during = []
    while eng.kv.loading or not during:
        during += timed_steps(1)
    assert len(during) >= 10                         # the engine kept stepping while the load was stalled
    assert statistics.median(during) <= 1.5 * statistics.median(alone) + 0.002
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("device", DEVICES)
def test_cancel_during_a_load_frees_the_blocks_once_the_copy_has_landed(tiny_model_dir, device):
    eng = LLMEngine(Config(model=tiny_model_dir, device=device, block_size=BS, kv_pool_tokens=40 * BS,
                           max_batched_tokens=64, kv_host_gib=0.01, kv_disk=False, prefix_cache=False))
    p = [(11 * i) % 800 + 40 for i in range(200)]
    run(eng, p, max_tokens=1)
    stall(eng, 0.5)
    eng.add_request("c", p + [3], SamplingParams(max_tokens=4))
    eng.step()
    reserved = list(eng.kv.loading["c"].block_table)
    eng.abort_request("c")
    eng.step()
    assert "c" in eng.kv.loading and all(eng.pool.ref_counts[b] > 0 for b in reserved)   # the copy is in flight
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("c", "abort")]
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    eng.shutdown()
