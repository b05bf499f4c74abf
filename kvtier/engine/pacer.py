"""Pacing: how many prompt tokens a step may carry beside running decodes, so that streams keep
their pace while a long prompt prefills.

A step that only decodes sets the pace (a moving average of its duration). Beside decodes a
prompt's chunk may take `max_itl_ratio` - 1 times the pace (its allowance): each step that
carries one measures how long its prompt tokens took, and the next chunk is sized from what
recent chunks cost, at most twice the last (so the budget finds the device's size in a few steps
instead of trying a whole `max_batched_tokens` chunk first). With nothing decoding, a step
carries up to `max_batched_tokens` prompt tokens. Measuring each step, rather than fixing a
chunk size, fits any device and any context length (a chunk's attention grows with it).

A chunk costs a fixed time plus a time per token (fitted to the recent chunks). Where the fixed
part alone takes more than the allowance (on a CPU with quantized weights every chunk
dequantizes the weights and runs the layers op by op: ~120 ms, where a decode step of one stream
takes 8-15), no chunk fits beside a step, and sizing chunks to fit shrank them to 4 tokens that
each paid the fixed time: a 2,048-token prompt took ~80 s beside one stream, the stream's steps
at 10x their pace. Chunks are then sized so that the fixed time is at most half a chunk's
(FIXED_SHARE), and the time a chunk took beyond its allowance is paid back with steps that only
decode, one allowance each: over those steps the streams keep `max_itl_ratio` of their pace.

A pace holds for about as many decodes as it was measured with (within PACE_SPAN): a decode step
of 32 sequences took 310 ms on a 2-core CPU, one of 1 8 ms. Beside decodes of no known pace a
step carries no prompt tokens: it measures the pace.

The streams' own steps get slower as their contexts grow, and a long prefill leaves no step that
only decodes: every REFRESH_EVERY-th step beside a prefill carries no prompt tokens, to measure
the pace again. Without it the pace would stay the one measured before the prompt arrived, and
the growing decodes would be charged to the prompt tokens, shrinking their budget step by step.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from kvtier.averages import moving_average

SMOOTHING = 0.3          # weight of the newest decode-only step
FIRST_BUDGET = 64        # prompt tokens of the first step beside decodes
MIN_BUDGET = 4           # a prompt always advances
REFRESH_EVERY = 16       # steps beside a prefill before one that only decodes
PACE_SPAN = 1.25         # a pace holds for decodes within this factor of those it was measured with
FIXED_SHARE = 0.5        # a chunk sized past its allowance: its fixed time at most this share of its time
CHUNKS_FITTED = 8        # recent chunks a chunk's fixed time and time per token are fitted to


class Pacer:
    def __init__(self, max_batched_tokens: int, max_itl_ratio: float):
        self.max_batched_tokens = max_batched_tokens
        self.max_itl_ratio = max_itl_ratio           # 0: no bound
        self.decode_seconds: float | None = None     # a decode-only step, as a moving average
        self.paced_decodes = 0                       # the decodes of the last decode-only step
        self.prompt_budget = min(FIRST_BUDGET, max_batched_tokens)
        self.steps_since_pace = 0                    # steps with prompt tokens since the last decode-only one
        self.chunks: deque[tuple[int, float]] = deque(maxlen=CHUNKS_FITTED)   # (tokens, seconds) beside decodes
        self.owed = 0.0          # prompt seconds taken beyond the allowances, paid back by decode-only steps
        self.fixed = 0.0         # a chunk's fixed seconds, as last fitted

    def budget(self, num_decodes: int) -> int:
        """Prompt tokens a step of num_decodes decodes may carry beside them."""
        if not num_decodes or not self.max_itl_ratio:
            return self.max_batched_tokens
        if not self.paces(num_decodes) or self.steps_since_pace >= REFRESH_EVERY or \
                self.owed >= self.allowance / 2:
            return 0
        return self.prompt_budget

    def paces(self, num_decodes: int) -> bool:
        """Whether the pace measured holds for a step of num_decodes decodes."""
        return self.decode_seconds is not None and \
            self.paced_decodes / PACE_SPAN <= num_decodes <= self.paced_decodes * PACE_SPAN

    @property
    def allowance(self) -> float:
        """Seconds a step's prompt tokens may take beside the decodes."""
        return (self.max_itl_ratio - 1) * self.decode_seconds

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """A step's duration (forward and sampling) with its decodes and prompt tokens."""
        if not num_decodes or seconds <= 0:
            return
        if not num_prompt_tokens:
            self._pace(num_decodes, seconds)
            return
        self.steps_since_pace += 1
        if not self.paces(num_decodes):     # its decodes' share of the step is not known
            return
        prompt_seconds = max(seconds - self.decode_seconds, 1e-6)
        # what went past the allowance is owed; a chunk that took less leaves room for noise, not a whole step
        self.owed = max(self.owed + prompt_seconds - self.allowance, -self.allowance / 2)
        self.chunks.append((num_prompt_tokens, prompt_seconds))
        fixed, per_token = self._chunk_cost()
        room = max(self.allowance, fixed / FIXED_SHARE) - fixed
        self.prompt_budget = self._bounded(min(round(room / per_token), 2 * self.prompt_budget))

    def _pace(self, num_decodes: int, seconds: float) -> None:
        """A decode-only step: the pace (afresh where the last was measured with other decodes); it pays back an
        allowance of what chunks owe."""
        known = self.decode_seconds if self.paces(num_decodes) else None
        self.decode_seconds = moving_average(known, seconds, SMOOTHING)
        self.paced_decodes = num_decodes
        self.steps_since_pace = 0
        self.owed = max(self.owed - self.allowance, 0.0)

    def _chunk_cost(self) -> tuple[float, float]:
        """A chunk's fixed seconds and seconds per token. The fixed time is fitted (a line through the recent chunks)
        where their sizes differ by 2x or more, else kept; it is at most what the quickest chunk took."""
        tokens, seconds = np.array(self.chunks, dtype=np.float64).T
        if tokens.max() >= 2 * tokens.min():
            self.fixed = float(np.polyfit(tokens, seconds, 1)[1])
        self.fixed = min(max(self.fixed, 0.0), float(seconds.min()))
        return self.fixed, max(float((seconds - self.fixed).sum() / tokens.sum()), 1e-9)

    def _bounded(self, budget: int) -> int:
        return max(MIN_BUDGET, min(budget, self.max_batched_tokens))
