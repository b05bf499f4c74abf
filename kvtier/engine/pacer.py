"""Pacing: how many prompt tokens a step may carry beside running decodes, so that streams keep
their pace while a long prompt prefills.

A step that only decodes sets the pace (a moving average of its duration). A step that also
prefills may take at most `max_itl_ratio` times as long: each such step measures how fast its
prompt tokens went, and the next one gets the tokens that fit in the time left over at that
rate, at most twice the last budget (so the budget finds the device's size in a few steps
instead of trying a whole `max_batched_tokens` chunk first). With nothing decoding, a step
carries up to `max_batched_tokens` prompt tokens. Measuring each step, rather than fixing a
chunk size, fits any device and any context length (a chunk's attention grows with it).

The streams' own steps get slower as their contexts grow, and a long prefill leaves no step that
only decodes: every REFRESH_EVERY-th step beside a prefill carries no prompt tokens, to measure
the pace again. Without it the pace would stay the one measured before the prompt arrived, and
the growing decodes would be charged to the prompt tokens, shrinking their budget step by step.
"""
from __future__ import annotations

from kvtier.averages import moving_average

SMOOTHING = 0.3          # weight of the newest decode-only step
FIRST_BUDGET = 64        # prompt tokens of the first step beside decodes
MIN_BUDGET = 4           # a prompt always advances
REFRESH_EVERY = 16       # steps beside a prefill before one that only decodes


class Pacer:
    def __init__(self, max_batched_tokens: int, max_itl_ratio: float):
        self.max_batched_tokens = max_batched_tokens
        self.max_itl_ratio = max_itl_ratio           # 0: no bound
        self.decode_seconds: float | None = None     # a decode-only step, as a moving average
        self.prompt_budget = min(FIRST_BUDGET, max_batched_tokens)
        self.steps_since_pace = 0                    # steps with prompt tokens since the last decode-only one

    def budget(self, decoding: bool) -> int:
        """Prompt tokens the step may carry beside its decodes."""
        if not decoding or not self.max_itl_ratio or self.decode_seconds is None:
            return self.max_batched_tokens
        return 0 if self.steps_since_pace >= REFRESH_EVERY else self.prompt_budget

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step's duration (forward and sampling) with its decodes and prompt tokens."""
        if not num_decodes or seconds <= 0:
            return
        if not num_prompt_tokens:
            self.decode_seconds = moving_average(self.decode_seconds, seconds, SMOOTHING)
            self.steps_since_pace = 0
            return
        self.steps_since_pace += 1
        if self.decode_seconds is None:
            return
        prompt_seconds = max(seconds - self.decode_seconds, 1e-6)
        left = (self.max_itl_ratio - 1) * self.decode_seconds
        fits = round(num_prompt_tokens * left / prompt_seconds)
        self.prompt_budget = max(MIN_BUDGET, min(fits, 2 * self.prompt_budget, self.max_batched_tokens))
