"""The pacer sizes the prompt tokens of a step beside running decodes from measured step times."""
import numpy as np

from kvtier.engine.pacer import FIRST_BUDGET, MIN_BUDGET, REFRESH_EVERY, Pacer


def test_no_bound_without_decodes_and_no_prompt_tokens_before_a_decode_step_is_measured():
    pacer = Pacer(2048, 2.0)
    assert pacer.budget(0) == 2048
    assert pacer.budget(4) == 0                  # nothing measured yet: the step measures the pace
    pacer.observe(4, 0, 0.05)
    assert pacer.budget(0) == 2048
    assert pacer.budget(4) == FIRST_BUDGET
    assert Pacer(2048, 0).budget(4) == 2048      # 0: no bound


def test_budget_settles_where_a_mixed_step_takes_the_ratio_of_a_decode_step():
    """A device whose decode step takes 50 ms and which computes 1000 prompt tokens/s: at ratio 2 a step may carry
    50 ms of prompt, 50 tokens."""
    pacer = Pacer(2048, 2.0)
    for _ in range(5):
        pacer.observe(4, 0, 0.05)
    budgets = []
    for _ in range(10):
        n = pacer.budget(4)
        pacer.observe(4, n, 0.05 + n / 1000)
        budgets.append(pacer.budget(4))
    assert budgets[-1] == 50
    assert budgets[0] <= 2 * FIRST_BUDGET     # it never grows faster than doubling


def test_budget_grows_by_doubling_on_a_fast_device_and_keeps_a_floor_on_a_slow_one():
    fast = Pacer(2048, 2.0)
    fast.observe(8, 0, 0.01)
    seen = []
    for _ in range(8):
        n = fast.budget(8)
        fast.observe(8, n, 0.01 + n / 1e6)       # a million prompt tokens/s
        seen.append(fast.budget(8))
    assert seen[:5] == [128, 256, 512, 1024, 2048] and seen[-1] == 2048
    slow = Pacer(2048, 2.0)
    slow.observe(1, 0, 0.01)
    slow.observe(1, 64, 10.0)                    # prompt tokens far too slow for the bound
    assert slow.budget(1) == MIN_BUDGET


def test_a_long_prefill_leaves_room_for_decode_only_steps_that_measure_the_pace_again():
    """Streams slow down as their contexts grow: every REFRESH_EVERY-th step beside a prefill carries no prompt
    tokens, and its time becomes part of the pace, which the budget is then sized by."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(4, 0, 0.05)
    budgets = []
    for _ in range(REFRESH_EVERY):
        budgets.append(pacer.budget(4))
        pacer.observe(4, budgets[-1], 0.1)
    assert min(budgets) > 0 and pacer.budget(4) == 0
    pacer.observe(4, 0, 0.15)                     # the streams' step now takes 0.15 s, not 0.05
    assert pacer.pace(4) > 0.05 and pacer.budget(4) > 0


def test_the_engine_paces_a_long_prompt_beside_running_streams(tiny_model_dir):
    """Wired through: steps that decode carry no more prompt tokens than the pacer allowed them, its budget comes
    from the engine's measured steps, and the long prompt still completes with the tokens it gets alone."""
    from kvtier.config import Config
    from kvtier.engine.engine import LLMEngine
    from kvtier.engine.sampling_params import SamplingParams

    def engine():
        return LLMEngine(Config(model=tiny_model_dir, block_size=16, kv_pool_tokens=4096, max_batched_tokens=512,
                                kv_host_gib=0, kv_disk=False, prefix_cache=False))
    long_prompt = [(13 * i) % 800 + 30 for i in range(1500)]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    alone = engine()
    alone.add_request("long", long_prompt, greedy)
    expected = []
    while alone.has_unfinished():
        expected += [t for out in alone.step() for t in out.new_token_ids]

    eng = engine()
    for i in range(2):
        eng.add_request(f"s{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(4):                       # decode-only steps set the pace
        eng.step()
    assert eng.scheduler.pacer.pace(2) is not None
    eng.add_request("long", long_prompt, greedy)
    schedule, budget, mixed, tokens = eng.scheduler.schedule, eng.scheduler.pacer.budget, [], []
    allowed = []

    def watched_budget(num_decodes):
        allowed.append(budget(num_decodes))
        return allowed[-1]

    def watched():
        batch = schedule()
        if batch.num_decodes:
            mixed.append((sum(batch.num_tokens) - batch.num_decodes, allowed[-1]))
        return batch
    eng.scheduler.pacer.budget, eng.scheduler.schedule = watched_budget, watched
    while eng.scheduler.find("long") is not None:
        tokens += [t for out in eng.step() if out.request_id == "long" for t in out.new_token_ids]
    assert tokens == expected
    assert mixed and all(carried <= allowed for carried, allowed in mixed)
    assert mixed[0][0] == FIRST_BUDGET       # the first step beside decodes tries a small chunk, not 512 tokens


def test_a_pace_holds_for_about_the_decodes_it_was_measured_with():
    """A decode step of 16 sequences is not one of 1: beside decodes whose pace is not measured a step carries no
    prompt tokens, and its decode-only step measures that pace. Charging a 16-decode step against a 1-decode pace
    took the budget to its floor (8 ms of decode against 150 ms)."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(1, 0, 0.008)
    assert pacer.budget(1) > 0
    assert pacer.budget(2) == pacer.budget(16) == 0       # outside the pace's span
    pacer.observe(16, 0, 0.15)
    assert pacer.pace(16) == 0.15 and pacer.pace(1) == 0.008      # each its own
    assert pacer.pace(14) == pacer.pace(15) == 0.15 and pacer.pace(12) is None and pacer.pace(18) is None
    assert pacer.budget(16) == FIRST_BUDGET
    pacer.observe(15, 0, 0.14)
    assert 0.14 < pacer.pace(16) < 0.15      # averaged


def test_decode_counts_that_come_and_go_measure_each_pace_once():
    """One stream, then two, then one again, every step (a prompt's last chunk joins the decodes, a stream ends):
    each count's pace is measured once, then prompts advance beside either."""
    pacer = Pacer(2048, 2.0)
    carried = []
    for step in range(12):
        decodes = 1 + step % 2
        n = pacer.budget(decodes)
        pacer.observe(decodes, n, 0.01 * decodes + n / 10_000)
        carried.append(n)
    assert carried[:2] == [0, 0] and all(carried[2:])


def test_a_step_beside_decodes_of_no_known_pace_teaches_nothing():
    pacer = Pacer(2048, 2.0)
    pacer.observe(1, 0, 0.01)
    pacer.observe(1, 16, 0.02)
    before = pacer.prompt_budget, list(pacer.chunks)
    pacer.observe(8, 64, 10.0)                # 8 decodes: their share of the 10 s is not known
    assert (pacer.prompt_budget, list(pacer.chunks)) == before and pacer.pace(8) is None


def simulate(pacer: Pacer, decode, fixed: float, per_token: float, prompt: int) -> tuple[list[int], list[float]]:
    """One stream decoding while a prompt of `prompt` tokens prefills on a device whose chunks cost `fixed` seconds
    plus `per_token` each, its decode-only steps `decode(step)`: the chunks carried, and the stream's step times,
    until the prompt is done."""
    chunks, steps = [], []
    while prompt > 0:
        n = min(pacer.budget(1), prompt)
        steps.append(decode(len(steps)) + (fixed + per_token * n if n else 0.0))
        pacer.observe(1, n, steps[-1])
        if n:
            chunks.append(n)
            prompt -= n
    return chunks, steps


def test_where_a_chunks_fixed_time_exceeds_the_allowance_chunks_amortize_it_and_the_streams_are_paid_back():
    """A CPU with quantized weights: a chunk costs 120 ms before its first token (2.5 ms each), a stream's step 10 ms.
    No chunk fits the 10 ms allowance; sized to fit, chunks shrank to MIN_BUDGET and each step took 14x the pace.
    Sized so the fixed time is half a chunk's (48 tokens), with the time past the allowance paid back by steps that
    only decode, the stream keeps about half its pace over the prefill, and the prompt is done 3x as soon."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(1, 0, 0.01)
    chunks, steps = simulate(pacer, lambda step: 0.01, 0.12, 0.0025, 2048)
    assert max(chunks) <= 2 * 48 and sorted(chunks)[len(chunks) // 2] == 48
    assert sum(steps) / len(steps) <= 2.0 * 0.01 * 1.1         # the stream's mean step within the ratio
    assert sum(steps) < 2048 / MIN_BUDGET * (0.01 + 0.12 + 0.0025 * MIN_BUDGET) / 3


def test_where_chunks_fit_the_allowance_the_steps_carry_them_as_before():
    """A GPU-like device (a chunk: 1 ms plus 10 us a token; a step 10 ms): chunks of the allowance less the fixed
    time, 900 tokens, and no step that only decodes but the pace's refreshes."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(1, 0, 0.01)
    chunks, steps = simulate(pacer, lambda step: 0.01, 0.001, 1e-5, 50_000)
    assert chunks[-2] == 900 and chunks[:5] == [64, 128, 256, 512, 900]
    decode_only = len(steps) - len(chunks)
    assert decode_only <= len(steps) // REFRESH_EVERY + 1


def test_on_a_noisy_device_whose_chunks_fit_nothing_is_owed():
    """Chunks sized to the allowance run over it about half the time, and the streams' steps slow as their contexts
    grow: where chunks fit, that shrinks the next chunk and nothing is owed, so no step only decodes but the pace's
    refreshes."""
    pacer, noise = Pacer(2048, 2.0), np.random.default_rng(0)
    pacer.observe(1, 0, 0.01)
    chunks, steps = simulate(pacer, lambda step: (0.01 + step * 1e-5) * noise.uniform(0.9, 1.1), 0.001, 1e-5,
                             50_000)
    assert pacer.owed_seconds == 0.0
    assert len(steps) - len(chunks) <= len(steps) // REFRESH_EVERY + 1


def test_a_stalled_chunk_counts_as_twice_its_plan_and_the_chunks_recover():
    """A chunk stalled for 10 s (a page-in, another process) beside a stream of 10 ms steps, where chunks amortize a
    120 ms fixed time: it owes twice its planned time at most (not 1,000 steps), and the chunks after it keep their
    size (in a least-squares line it made the time per token 10x, and the chunks 4 tokens for good)."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(1, 0, 0.01)
    simulate(pacer, lambda step: 0.01, 0.12, 0.0025, 512)
    while not pacer.budget(1):      # what the prompt's chunks owed, paid back
        pacer.observe(1, 0, 0.01)
    planned = pacer.fixed_seconds / 0.5
    n = pacer.budget(1)
    pacer.observe(1, n, 10.0)
    assert 0 < pacer.owed_seconds <= 2 * planned
    chunks, _ = simulate(pacer, lambda step: 0.01, 0.12, 0.0025, 1024)
    assert set(chunks[:-1]) == {48}


def test_a_chunk_quicker_than_the_decodes_noise_lets_the_budget_grow():
    """A step with a chunk that took less than the decodes' pace (noise, or costs that went down): its cost is not
    fitted, the oldest cost measured goes, and the budget doubles."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(1, 0, 0.01)
    pacer.observe(1, 64, 0.65)                 # 10 ms a token: 1 fits the allowance
    assert pacer.budget(1) == MIN_BUDGET
    pacer.observe(1, MIN_BUDGET, 0.009)
    assert not pacer.chunks and pacer.budget(1) == 2 * MIN_BUDGET
