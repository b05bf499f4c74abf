"""Which tokens each decoding sequence proposes for its next step, and how many: `--speculative ngram` (prompt
lookup, here) or `draft` (a draft model decodes them: draft_model.py; this says how many).

A proposal pays off only if what it is expected to add beats what its rows cost, and both vary: a draft row costs
nearly nothing where the products are memory-bound (a GPU, float weights) and most of a decode step where they
are compute-bound (ggml's quantized kernels on a small CPU), or where attention over a long context dominates. So
the speculator measures both:
- what k draft rows add to a step, in decode steps' time per token, for each k: from the durations of steps that
  only decode and of steps that also verify (neither carrying prompt tokens). It is not linear in k: on a small CPU
  ggml's products of two rows take about twice one row's, while each further row adds about half of it;
- each sequence's acceptance rate α, the chance that a proposed token is accepted given the ones before it were:
  accepted tokens over proposed positions tried (the accepted ones and the first rejected one), decayed so that it
  follows the conversation.
It then proposes the k (up to `--num-speculative-tokens`) that maximizes expected tokens per unit of time:
(B + α + α² + ... + α^k) / (B + c(k)) for B sequences decoding and k rows costing c(k). Where no k pays, the
sequence sits out PROBE_EVERY steps and then probes with one token, so that its α can recover: a conversation
with nothing to copy pays for few verify rows and decodes at its plain speed. Costs are measured against the
latest decode-only step; where every step would verify (a draft model always has a proposal), one step in
REMEASURE_EVERY proposes nothing and measures that again. With a draft model, what k rows add includes its k decode
rounds (assumed to cost a decode step each until measured), and a probe costs the draft model the tokens it skipped
while paused, a DFlash drafter a whole block's forward, so their pauses double after each probe that finds nothing
paying (up to 2^MAX_BACKOFF PROBE_EVERY).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.averages import moving_average
from kvtier.spec.ngram import LOOKUP_MAX, LOOKUP_MIN, PromptLookup

PROBE_EVERY = 16       # decode steps a sequence sits out when no proposal pays, before it probes with one token
DECAY = 0.8            # weight of a sequence's past verify steps in its acceptance rate, per step
PRIOR = (3.0, 4.0)     # a new sequence's (accepted, tried) before any verify step: α = 0.75
SMOOTHING = 0.2        # weight of the newest step in the measured step times
ROW_COST_PRIOR = 0.3   # a draft row's cost in decode tokens' time, until k rows' is measured: low, so k gets tried
ROUND_COST_PRIOR = 1.0  # and a draft model's round, until measured: a decode step of the model itself
MAX_BACKOFF = 4        # a model drafter's pauses double after each probe that pays nothing, up to 2^4 PROBE_EVERY
REMEASURE_EVERY = 64   # steps that verify, at most, before one that only decodes measures a decode step again


@dataclass
class SpecState:
    """One sequence's speculation: its prompt lookup, its acceptance, and its counts."""
    lookup: PromptLookup = field(default_factory=PromptLookup)
    accepted_weight: float = PRIOR[0]     # decayed accepted tokens
    tried_weight: float = PRIOR[1]        # decayed proposed positions tried (accepted ones, then the rejected one)
    pause: int = 0                        # decode steps to sit out before probing again
    probe: bool = False                   # after the pause, propose one token whatever it is expected to pay
    backoff: int = 0                      # a draft model's pauses in a row after probes: each doubles the next
    proposed: int = 0                     # draft tokens proposed over the request
    accepted: int = 0                     # of those, accepted
    verify_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted_weight / self.tried_weight


class Speculator:
    def __init__(self, method: str, max_tokens: int, lookup: tuple[int, int] = (LOOKUP_MIN, LOOKUP_MAX)):
        """method: a Config.speculative it has checked (ngram, draft, dflash); lookup: the shortest and longest
        ending an ngram proposal looks up."""
        self.method, self.max_tokens, self.lookup = method, max_tokens, lookup
        self.proposed = self.accepted = self.verify_steps = 0     # over every request, for /metrics
        self.decode_seconds: float | None = None     # a step that only decodes, per decoding sequence
        self.draft_costs: dict[int, float] = {}      # k → what k draft rows add to a step, in decode_seconds
        self.steps_since_plain = 0                   # steps that verified since the last that only decoded
        self.row_cost_prior = ROW_COST_PRIOR + (ROUND_COST_PRIOR if method == "draft" else 0.0)

    def measure_now(self) -> bool:
        """Whether this step should only decode, to measure what a decode step costs now (a new server speculates
        from its first step, on the prior costs). Asked once a step: a step it says so for starts the count again,
        whether or not it could be measured (one carrying prompt tokens is not)."""
        if self.steps_since_plain < REMEASURE_EVERY:
            return False
        self.steps_since_plain = 0
        return True

    def new_state(self) -> SpecState:
        return SpecState(lookup=PromptLookup(*self.lookup))

    def draft_cost(self, k: int) -> float:
        """What k draft rows add to a step, in units of one sequence's share of a decode-only step: measured, or
        scaled from the nearest k measured."""
        if not self.draft_costs:
            return self.row_cost_prior * k
        nearest = min(self.draft_costs, key=lambda m: (abs(m - k), m))
        return self.draft_costs[nearest] * k / nearest

    def propose(self, state: SpecState, tokens: list[int], room: int, batch: int = 1) -> list[int]:
        """By prompt lookup, the draft for a sequence's next step, decoding beside batch - 1 others: at most `room`
        tokens (what its max_tokens leaves after the token the step samples anyway)."""
        if room <= 0 or self._sits_out(state):
            return []
        draft = state.lookup.propose(tokens, min(self.max_tokens, room))
        return draft[:self._length(state, len(draft), batch)]

    def plan(self, state: SpecState, room: int, batch: int = 1) -> int:
        """For a draft model: how many tokens the sequence proposes for its next step (0 for none)."""
        if room <= 0 or self._sits_out(state):
            return 0
        return self._length(state, min(self.max_tokens, room), batch)

    def _sits_out(self, state: SpecState) -> bool:
        """Whether the sequence sits this step out, counting its pause down."""
        if state.pause:
            state.pause -= 1
            return True
        return False

    def _length(self, state: SpecState, most: int, batch: int) -> int:
        """The draft length that pays best, of at most `most` tokens; where none pays, a probe of one token every
        PROBE_EVERY steps."""
        k = self._best_length(state.acceptance, most, batch)
        if most and not k:
            k, state.probe = int(state.probe), not state.probe
            state.pause = 0 if k else PROBE_EVERY << state.backoff
            # a model drafter's probe costs it the tokens it skipped (a draft model) or a block (DFlash): where probes
            # keep finding nothing that pays, it probes less and less often
            state.backoff = min(state.backoff + (not k and self.method != "ngram"), MAX_BACKOFF)
        elif k:
            state.backoff = 0
        return k

    def _best_length(self, alpha: float, most: int, batch: int) -> int:
        best, best_rate, expected = 0, 1.0, 0.0
        for k in range(1, most + 1):
            expected += alpha ** k
            rate = (batch + expected) / (batch + self.draft_cost(k))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verified(self, state: SpecState, proposed: int, accepted: int, rejected: bool) -> None:
        """A verify step accepted `accepted` of the `proposed` tokens, and rejected the next one, or ended before
        it (a stop, the pager)."""
        state.proposed, state.accepted, state.verify_steps = (state.proposed + proposed, state.accepted + accepted,
                                                              state.verify_steps + 1)
        self.proposed, self.accepted, self.verify_steps = (self.proposed + proposed, self.accepted + accepted,
                                                           self.verify_steps + 1)
        state.accepted_weight = DECAY * state.accepted_weight + accepted
        state.tried_weight = DECAY * state.tried_weight + accepted + rejected

    def observe_step(self, decodes: int, drafted: int, seconds: float) -> None:
        """A step that carried `decodes` decoding sequences, `drafted` draft tokens among them, and no prompt
        tokens."""
        if not decodes or seconds <= 0:
            return
        self.steps_since_plain = self.steps_since_plain + 1 if drafted else 0
        if not drafted:
            per_sequence = seconds / decodes
            self.decode_seconds = moving_average(self.decode_seconds, per_sequence, SMOOTHING)
        elif self.decode_seconds is not None and drafted <= self.max_tokens:
            # against the latest decode-only steps: both grow with the context
            cost = max(0.0, seconds - decodes * self.decode_seconds) / self.decode_seconds
            self.draft_costs[drafted] = moving_average(self.draft_costs.get(drafted), cost, SMOOTHING)

    def stats(self) -> dict:
        return {"method": self.method, "proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
                "verify_steps": self.verify_steps}
