"""The pacer sizes the prompt tokens of a step beside running decodes from measured step times."""
from kvtier.engine.pacer import FIRST_BUDGET, MIN_BUDGET, Pacer


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
