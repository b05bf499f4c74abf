"""Pool, block tables, scheduling and preemption, without a model."""
import pytest
import torch

from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.kv.manager import RUN_COPY_DECODES, KVManager
from kvtier.kv.pool import KVPool, PoolExhausted
from kvtier.kv.state import KVState
from kvtier.kv.tiers.stack import TierStack

BS = 4


def make_pool(num_blocks: int, values_transposed: bool = False, num_layers: int = 1) -> KVPool:
    """values_transposed: a pool as ggml's decode steps read it."""
    return KVPool(num_layers=num_layers, num_kv_heads=1, head_dim=2, block_size=BS, num_tokens=num_blocks * BS,
                  dtype=torch.float32, device=torch.device("cpu"), values_transposed=values_transposed)


def make_scheduler(pool: KVPool, max_batched_tokens: int, max_num_seqs: int) -> Scheduler:
    return Scheduler(KVManager(pool, TierStack([])), max_batched_tokens, max_num_seqs)


def make_seq(i: int, prompt_len: int) -> Sequence:
    seq = Sequence(f"r{i}", list(range(prompt_len)), SamplingParams(max_tokens=8), None, arrival=i)
    seq.kv = KVState(seq.request_id, seq.token_ids, prompt_len + 8)
    return seq


def run_step(sched: Scheduler):
    """What the engine does after a forward: count computed tokens, append a token when caught up."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(0)
    return batch


def test_pool_allocates_and_frees_distinct_blocks():
    pool = make_pool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    assert len(set(a + b)) == 4 and pool.num_free_blocks == 0
    assert not pool.can_allocate(1)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 2 and pool.blocks_for(5) == 2 and pool.blocks_for(4) == 1


def test_pool_shape_and_its_padding_block_zeroed():
    """The pool is not filled at start-up, but block 0, whose slot 0 pads batched decode contexts, is zeros; one
    block past the last pads graph-captured decode steps and is never handed out."""
    pool = make_pool(3)
    assert pool.k_cache.shape == pool.v_cache.shape == (1, 4 * BS, 1, 2) and pool.pad_slot == 3 * BS
    assert sorted(pool.allocate(3)) == [0, 1, 2]
    assert pool.slots_kv(torch.arange(BS)).abs().sum() == 0


def runs_of(blocks: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(blocks, blocks[1:]))


def test_sequences_growing_side_by_side_keep_their_blocks_in_long_runs():
    """CPU attention reads each run of consecutive slots in one call: four tables growing a block at a time in
    turn each continue their own run, where handing out blocks in order would interleave them block by block."""
    pool = make_pool(64)
    tables = [pool.allocate(1) for _ in range(4)]
    for _ in range(12):
        for table in tables:
            table += pool.allocate(1, after=table[-1])
    assert len({b for t in tables for b in t}) == 52
    assert max(map(runs_of, tables)) <= 3 and sum(map(runs_of, tables)) <= 7     # in order: 13 runs each


def test_a_long_prompt_in_chunks_lies_in_one_run_of_a_tight_pool():
    """ggml's decode steps read a context in consecutive slots in place and gather any other: a prompt of 90% of
    the pool, admitted a chunk at a time, starts where all of its blocks and its answer's fit (the middle of the
    empty pool would leave it half the room it needs)."""
    pool = make_pool(40)
    sched = make_scheduler(pool, max_batched_tokens=8, max_num_seqs=1)
    seq = make_seq(0, 36 * BS)
    sched.add(seq)
    for _ in range(36 * BS // 8 + 2):       # the prompt in chunks of 8 tokens, then two decode steps
        run_step(sched)
    assert seq.num_computed_tokens == 36 * BS + 2 and len(seq.kv.block_table) == 37
    assert runs_of(seq.kv.block_table) == 1


def test_empty_blocks_are_taken_before_cached_ones_are_evicted():
    pool = make_pool(4)
    blocks = pool.allocate(4)
    pool.seal(blocks[3], b"tail")       # a sealed tail block is the first one eviction would take
    pool.free(blocks)
    assert blocks[3] not in pool.allocate(3)
    assert pool.match_prefix([b"tail"]) == [blocks[3]]


def test_block_table_grows_one_block_per_block_size_tokens():
    sched = make_scheduler(make_pool(8), max_batched_tokens=64, max_num_seqs=4)
    seq = make_seq(0, 5)
    sched.add(seq)
    run_step(sched)
    assert len(seq.kv.block_table) == 2 and seq.num_computed_tokens == 5
    for _ in range(3):                      # tokens 6, 7, 8 fit in block 2
        run_step(sched)
    assert len(seq.kv.block_table) == 2
    run_step(sched)                         # position 8 needs a third block
    assert len(seq.kv.block_table) == 3


def test_chunked_prefill_respects_token_budget_and_decodes_go_first():
    sched = make_scheduler(make_pool(64), max_batched_tokens=10, max_num_seqs=4)
    short, long = make_seq(0, 3), make_seq(1, 40)
    sched.add(short)
    run_step(sched)                          # short prefilled, now decoding
    sched.add(long)
    for _ in range(4):
        batch = run_step(sched)
        assert sum(batch.num_tokens) <= 10
        assert batch.seqs[0] is short and batch.num_tokens[0] == 1   # decode is never stalled
    assert long.num_computed_tokens == 4 * 9


def test_max_num_seqs_limits_running():
    sched = make_scheduler(make_pool(64), max_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i, 4))
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_first():
    pool = make_pool(4)
    sched = make_scheduler(pool, max_batched_tokens=100, max_num_seqs=4)
    old, new = make_seq(0, 8), make_seq(1, 7)
    sched.add(old)
    sched.add(new)
    run_step(sched)                          # old: 2 blocks (9 tokens after sampling), new: 2 blocks
    assert pool.num_free_blocks == 0
    batch = run_step(sched)                  # old needs a third block: new is preempted
    assert batch.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.kv.block_table == [] and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and batch.seqs == [old]
    assert len(new.token_ids) == 8           # the token it already produced is kept and recomputed later
    sched.finish(old, "length")
    assert pool.num_free_blocks == 4
    run_step(sched)
    assert new.status is SequenceStatus.RUNNING and new.num_computed_tokens == 8


def test_lone_sequence_that_cannot_grow_preempts_itself():
    pool = make_pool(2)
    sched = make_scheduler(pool, max_batched_tokens=100, max_num_seqs=4)
    seq = make_seq(0, 8)
    sched.add(seq)
    run_step(sched)
    batch = run_step(sched)                  # needs a third block that does not exist
    assert batch.preempted == [seq] and pool.num_free_blocks == 2


def test_finish_and_find():
    pool = make_pool(8)
    sched = make_scheduler(pool, max_batched_tokens=100, max_num_seqs=4)
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert sched.find("r1") is b and sched.find("nope") is None
    sched.finish(b, "abort")
    assert b.is_finished and b.finish_reason == "abort" and sched.find("r1") is None
    sched.finish(a, "stop")
    assert not sched.has_unfinished() and pool.num_free_blocks == 8


def answered(kv: KVManager, pool: KVPool, prompt: list[int], answer: int) -> KVState:
    """A sequence whose prompt and `answer` decoded tokens were computed (random K/V) and sealed, then finished."""
    state = KVState("first", list(prompt), len(prompt) + answer + 8)
    assert kv.admit(state, budget=10 ** 6) == (0, len(prompt))
    state.token_ids += list(range(1000, 1000 + answer))
    assert kv.reserve(state, len(state.token_ids))
    for cache in pool.caches:
        cache.normal_()
    kv.commit(state, len(state.token_ids), None, prompt_done=True, decoded=True)
    kv.finish(state)
    return state


@pytest.mark.parametrize("pool_blocks", [64, 30])
def test_a_prefix_hit_that_would_scatter_a_ggml_context_is_copied_into_one_run(pool_blocks):
    """A prompt sent again finds its cached blocks followed by its first answer's: its own blocks would lie apart,
    which ggml's decode steps (over a pool keeping V transposed) gather every step. With room in the pool its
    cached blocks are copied into one run with the rest of its blocks, bitwise, and their keys go with them (no one
    else holds the originals), so the next prompt finds them there; with no room (under half the pool's blocks
    empty after the copy) it takes the cached blocks."""
    pool = make_pool(pool_blocks, values_transposed=True, num_layers=2)
    kv = KVManager(pool, TierStack([]))
    prompt = list(range(10 * BS + 1))        # 10 full blocks before its last token
    first = answered(kv, pool, prompt, answer=3 * BS)
    cached = [pool.cached[key] for key in first.block_keys[:10]]
    payloads = [pool.read_block(block) for block in cached]
    again = KVState("again", list(prompt), len(prompt) + 64)
    assert kv.admit(again, budget=10 ** 6) == (10 * BS, 1)
    roomy = pool_blocks == 64
    assert runs_of(again.block_table) == (1 if roomy else 2)
    assert (again.block_table[:10] == cached) is not roomy
    for block, payload in zip(again.block_table[:10], payloads):
        assert torch.equal(pool.read_block(block), payload)
    assert [pool.ref_counts[b] for b in again.block_table[:10]] == [1] * 10
    if roomy:       # the originals given back, empty
        assert all(pool.ref_counts[b] == 0 and pool.keys[b] is None for b in cached)
    table = again.block_table
    kv.finish(again)
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.match_prefix(first.block_keys[:10]) == table[:10]     # where the next prompt finds them


def test_a_copied_run_leaves_the_keys_of_blocks_others_hold_where_they_are():
    """Requests sharing a system prompt: one that decodes a few tokens takes the cached blocks as they lie; one that
    may decode more copies them into a run of its own, and the blocks the first still holds keep their keys."""
    pool = make_pool(64, values_transposed=True)
    kv = KVManager(pool, TierStack([]))
    prompt = list(range(10 * BS + 1))
    first = answered(kv, pool, prompt, answer=3 * BS)
    cached = [pool.cached[key] for key in first.block_keys[:10]]
    short = KVState("short", list(prompt), len(prompt) + RUN_COPY_DECODES - 1)
    kv.admit(short, budget=10 ** 6)
    assert short.block_table[:10] == cached
    long = KVState("long", list(prompt), len(prompt) + 64)
    kv.admit(long, budget=10 ** 6)
    assert runs_of(long.block_table) == 1 and not set(long.block_table) & set(cached)
    assert all(pool.keys[b] is not None for b in cached) and all(pool.keys[b] is None for b in long.block_table)
    on_device = make_pool(64)     # a pool no ggml step reads
    kv = KVManager(on_device, TierStack([]))
    first = answered(kv, on_device, prompt, answer=3 * BS)
    again = KVState("again", list(prompt), len(prompt) + 64)
    kv.admit(again, budget=10 ** 6)
    assert again.block_table[:10] == [on_device.cached[key] for key in first.block_keys[:10]]


def test_a_run_of_empty_blocks_is_allocated_whole_or_not_at_all():
    pool = make_pool(10)
    blocks = pool.allocate(10)
    pool.seal(blocks[4], b"cached")
    pool.free(blocks)                       # empty: 0-3 and 5-9
    assert pool.allocate_run(6) is None and pool.allocate_run(5) == [5, 6, 7, 8, 9]
    assert pool.continues(2) and not pool.continues(3) and not pool.continues(9)
    assert pool.allocate_run(4, wants=4) == [0, 1, 2, 3] and pool.match_prefix([b"cached"]) == [4]
    pool.free([4])
    assert pool.allocate_run(1, wants=1) is None            # no empty block left: the cached one is not taken
    pool.move_key(4, 5)
    assert pool.cached[b"cached"] == 5 and pool.allocate_run(1) == [4]


def test_a_partial_block_published_in_a_prompts_stead_does_not_cut_the_empty_blocks_in_two():
    """A prompt sent again that shares a block with its first answer (its last block, remembered when the answer
    filled it): the sequence takes that block, its copy is published instead, at the start of the longest run of
    empty blocks, not its middle, and the sequence's own blocks still find one run."""
    pool = make_pool(64, values_transposed=True)
    kv = KVManager(pool, TierStack([]))
    prompt = list(range(10 * BS + 3))        # its last token the third of its block
    first = answered(kv, pool, prompt, answer=3 * BS)
    again = KVState("again", list(prompt), len(prompt) + 64)
    assert kv.admit(again, budget=10 ** 6) == (10 * BS + 2, 1)
    assert runs_of(again.block_table) == 1
    published = pool.cached[first.block_keys[10]]
    assert published not in again.block_table and not pool._empty[published - 1]
