"""The pacer sizes the prompt tokens of a step beside running decodes from measured step times."""
from kvtier.engine.pacer import FIRST_BUDGET, MIN_BUDGET, REFRESH_EVERY, Pacer


def test_no_bound_without_decodes_or_before_a_decode_step_is_measured():
    pacer = Pacer(2048, 2.0)
    assert pacer.budget(decoding=False) == 2048
    assert pacer.budget(decoding=True) == 2048          # nothing measured yet
    pacer.observe(4, 0, 0.05)
    assert pacer.budget(decoding=False) == 2048
    assert pacer.budget(decoding=True) == FIRST_BUDGET
    assert Pacer(2048, 0).budget(decoding=True) == 2048  # 0: no bound


def test_budget_settles_where_a_mixed_step_takes_the_ratio_of_a_decode_step():
    """A device whose decode step takes 50 ms and which computes 1000 prompt tokens/s: at ratio 2 a step may carry
    50 ms of prompt, 50 tokens."""
    pacer = Pacer(2048, 2.0)
    for _ in range(5):
        pacer.observe(4, 0, 0.05)
    budgets = []
    for _ in range(10):
        n = pacer.budget(decoding=True)
        pacer.observe(4, n, 0.05 + n / 1000)
        budgets.append(pacer.budget(decoding=True))
    assert budgets[-1] == 50
    assert budgets[0] <= 2 * FIRST_BUDGET     # it never grows faster than doubling


def test_budget_grows_by_doubling_on_a_fast_device_and_keeps_a_floor_on_a_slow_one():
    fast = Pacer(2048, 2.0)
    fast.observe(8, 0, 0.01)
    seen = []
    for _ in range(8):
        n = fast.budget(decoding=True)
        fast.observe(8, n, 0.01 + n / 1e6)       # a million prompt tokens/s
        seen.append(fast.budget(decoding=True))
    assert seen[:5] == [128, 256, 512, 1024, 2048] and seen[-1] == 2048
    slow = Pacer(2048, 2.0)
    slow.observe(1, 0, 0.01)
    slow.observe(1, 64, 10.0)                    # prompt tokens far too slow for the bound
    assert slow.budget(decoding=True) == MIN_BUDGET


def test_a_long_prefill_leaves_room_for_decode_only_steps_that_measure_the_pace_again():
    """Streams slow down as their contexts grow: every REFRESH_EVERY-th step beside a prefill carries no prompt
    tokens, and its time becomes part of the pace, which the budget is then sized by."""
    pacer = Pacer(2048, 2.0)
    pacer.observe(4, 0, 0.05)
    budgets = []
    for _ in range(REFRESH_EVERY):
        budgets.append(pacer.budget(decoding=True))
        pacer.observe(4, budgets[-1], 0.1)
    assert min(budgets) > 0 and pacer.budget(decoding=True) == 0
    pacer.observe(4, 0, 0.15)                     # the streams' step now takes 0.15 s, not 0.05
    assert pacer.decode_seconds > 0.05 and pacer.budget(decoding=True) > 0


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
    assert eng.scheduler.pacer.decode_seconds is not None
    eng.add_request("long", long_prompt, greedy)
    schedule, mixed, tokens = eng.scheduler.schedule, [], []

    def watched():
        allowed = eng.scheduler.pacer.budget(decoding=True)
        batch = schedule()
        if batch.num_decodes:
            mixed.append((sum(batch.num_tokens) - batch.num_decodes, allowed))
        return batch
    eng.scheduler.schedule = watched
    while eng.scheduler.find("long") is not None:
        tokens += [t for out in eng.step() if out.request_id == "long" for t in out.new_token_ids]
    assert tokens == expected
    assert mixed and all(carried <= allowed for carried, allowed in mixed)
    assert mixed[0][0] == FIRST_BUDGET       # the first step beside decodes tries a small chunk, not 512 tokens
