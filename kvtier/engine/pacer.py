"""Pacing: how many prompt tokens a step may carry beside running decodes, so that streams keep
their pace while a long prompt prefills.

A step that only decodes sets the pace (a moving average of its duration). Beside decodes a
prompt's chunk may take `max_itl_ratio` - 1 times the pace (its allowance): each step that
carries one measures how long its prompt tokens took, and the next chunk is sized from what
recent chunks cost, at most twice the last (so the budget finds the device's size in a few steps
instead of trying a whole `max_batched_tokens` chunk first). With nothing decoding, a step
carries up to `max_batched_tokens` prompt tokens. Measuring each step, rather than fixing a
chunk size, fits any device and any context length (a chunk's attention grows with it).

A chunk costs a fixed time plus a time per token (fitted to the recent chunks). On a CPU with
quantized weights every chunk dequantizes the weights and runs the layers op by op, ~120 ms
before its first token, where a decode step of one stream takes 8-15: sized to fit the allowance,
chunks shrank to 4 tokens that each paid the fixed time, and a 2,048-token prompt took ~80 s
beside one stream, whose steps ran at 10x its pace. Where the fixed time is over FIXED_SHARE of
the allowance, a chunk is sized so that the fixed time is that share of its time, and what the
chunk took past its allowance is owed: steps that only decode pay it back, an allowance each, so
over those steps the streams keep `max_itl_ratio` of their pace.

A pace holds for decode counts in its bucket (PACE_SPAN wide on a log scale: decode steps of 32
sequences took 310 ms on a 2-core CPU, of one 8 ms): a step beside decodes of no pace measured
yet carries no prompt tokens, and measures it. What chunks owe is paid back at the pace of the
decodes that run then, and a refresh measures theirs.

The streams' own steps get slower as their contexts grow, and a long prefill leaves no step that
only decodes: every REFRESH_EVERY-th step beside a prefill carries no prompt tokens, to measure
the pace again. Without it the pace would stay the one measured before the prompt arrived, and
the growing decodes would be charged to the prompt tokens, shrinking their budget step by step.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from kvtier.averages import moving_average

SMOOTHING = 0.3          # weight of the newest decode-only step
FIRST_BUDGET = 64        # prompt tokens of the first step beside decodes
MIN_BUDGET = 4           # the fewest prompt tokens a step beside decodes carries, where it carries any
REFRESH_EVERY = 16       # steps beside a prefill before one that only decodes
PACE_SPAN = 1.25         # a pace holds for decode counts in its bucket, this wide on a log scale
FIXED_SHARE = 0.5        # a chunk's fixed time, where over this share of the allowance: this share of its time
CHUNKS_FITTED = 8        # recent chunks a chunk's fixed time and time per token are fitted to


class Pacer:
    def __init__(self, max_batched_tokens: int, max_itl_ratio: float):
        self.max_batched_tokens = max_batched_tokens
        self.max_itl_ratio = max_itl_ratio           # 0: no bound
        self.paces: dict[int, float] = {}            # decode-only steps' seconds (moving averages), by `_bucket`
        self.prompt_budget = min(FIRST_BUDGET, max_batched_tokens)
        self.steps_since_pace = 0                    # steps with prompt tokens since the last decode-only one
        self.chunks: deque[tuple[int, float]] = deque(maxlen=CHUNKS_FITTED)   # (tokens, seconds) beside decodes
        self.fixed_seconds = 0.0                     # a chunk's fixed time, as last fitted
        self.token_seconds = 0.0                     # and its time per token
        self.owed_seconds = 0.0                      # chunks' time past their allowances, not yet paid back

    def budget(self, num_decodes: int) -> int:
        """Prompt tokens a step of num_decodes decodes may carry beside them."""
        if not num_decodes or not self.max_itl_ratio:
            return self.max_batched_tokens
        pace = self.pace(num_decodes)
        if pace is None or self.steps_since_pace >= REFRESH_EVERY or self.owed_seconds >= self._allowance(pace) / 2:
            return 0
        # a budget learned beside slower decodes is cut to what fits beside these
        return min(self.prompt_budget, self._fitting(self._allowance(pace)))

    def pace(self, num_decodes: int) -> float | None:
        """A decode-only step's seconds with num_decodes decodes, if measured."""
        return self.paces.get(_bucket(num_decodes))

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step's duration (forward and sampling) with its decodes and prompt tokens."""
        if not num_decodes:
            self.owed_seconds = 0.0      # no stream waits for it
            return
        if seconds <= 0 or not self.max_itl_ratio:
            return
        if not num_prompt_tokens:
            self._measure_pace(num_decodes, seconds)
            return
        self.steps_since_pace += 1
        pace = self.pace(num_decodes)
        if pace is None:      # a step budget() did not size: its decodes' share of it is not known
            return
        prompt_seconds, allowance = seconds - pace, self._allowance(pace)
        if prompt_seconds <= 0:      # too quick to tell from the decodes' noise: the oldest cost goes, the budget grows
            if self.chunks:
                self.chunks.popleft()
            self.prompt_budget = self._bounded(2 * self.prompt_budget)
            return
        planned = self._planned(allowance)
        if planned > allowance:      # sized past the allowance: what it took beyond is owed (a stall: 2x its plan)
            self.owed_seconds = max(self.owed_seconds + min(prompt_seconds, 2 * planned) - allowance, 0.0)
        self.chunks.append((num_prompt_tokens, prompt_seconds))
        self._fit()
        self.prompt_budget = self._bounded(min(self._fitting(allowance), 2 * self.prompt_budget))

    def _measure_pace(self, num_decodes: int, seconds: float) -> None:
        """A decode-only step: the pace of its decode count, and an allowance of what chunks owe paid back."""
        bucket = _bucket(num_decodes)
        self.paces[bucket] = moving_average(self.paces.get(bucket), seconds, SMOOTHING)
        self.steps_since_pace = 0
        self.owed_seconds = max(self.owed_seconds - self._allowance(self.paces[bucket]), 0.0)

    def _allowance(self, pace: float) -> float:
        """Seconds a step's prompt tokens may take beside decodes whose step takes `pace`."""
        return (self.max_itl_ratio - 1) * pace

    def _planned(self, allowance: float) -> float:
        """Seconds a chunk beside decodes is sized to take."""
        return max(allowance, self.fixed_seconds / FIXED_SHARE)

    def _fitting(self, allowance: float) -> int:
        """Prompt tokens a chunk planned beside that allowance takes, from the recent chunks' cost."""
        if not self.chunks:
            return self.max_batched_tokens
        return self._bounded(round((self._planned(allowance) - self.fixed_seconds) / self.token_seconds))

    def _fit(self) -> None:
        """A chunk's fixed time and time per token from the recent chunks, by medians, so that a chunk stalled by a
        page-in or another process moves neither (Theil-Sen): the fixed time what the median slope between pairs of
        chunks whose sizes differ by 2x or more leaves of each (with no such pair, as it was; at most what the
        quickest chunk took), the time per token the median of the rest per token."""
        tokens, seconds = np.array(self.chunks, dtype=np.float64).T
        i, j = np.triu_indices(len(tokens), 1)
        apart = np.maximum(tokens[i], tokens[j]) >= 2 * np.minimum(tokens[i], tokens[j])
        if apart.any():
            slope = float(np.median((seconds[j] - seconds[i])[apart] / (tokens[j] - tokens[i])[apart]))
            self.fixed_seconds = float(np.median(seconds - max(slope, 0.0) * tokens))
        self.fixed_seconds = min(max(self.fixed_seconds, 0.0), float(seconds.min()))
        self.token_seconds = max(float(np.median((seconds - self.fixed_seconds) / tokens)), 1e-9)

    def _bounded(self, budget: int) -> int:
        return max(MIN_BUDGET, min(budget, self.max_batched_tokens))


def _bucket(num_decodes: int) -> int:
    """The bucket of a decode count: PACE_SPAN wide on a log scale (1, 2, 3, 4, 5, 6, 7-8, 9-10, 11-13, 14-16, ...)."""
    return round(math.log(num_decodes) / math.log(PACE_SPAN))
