"""Which tokens each decoding sequence proposes for its next step, and how many: `--speculative ngram`.

Each sequence proposes up to its own k tokens, which adapts to how many the target accepted: a full acceptance
raises it by one (up to `--num-speculative-tokens`), a partial one sets it just past what was accepted. A step that
accepts nothing sits the sequence out of speculation for a while, twice as long after each such step in a row (up
to MAX_PAUSE steps), so a conversation whose continuation is nowhere in its context pays for few verify rows and
decodes at its plain speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.spec.ngram import NgramIndex

MAX_PAUSE = 32      # decode steps a sequence sits out at most after proposals that were all rejected


@dataclass
class SpecState:
    """One sequence's speculation: its proposer's index, its current k, and its counts."""
    k: int
    index: NgramIndex = field(default_factory=NgramIndex)
    pause: int = 0            # decode steps to sit out before proposing again
    misses: int = 0           # verify steps in a row that accepted nothing
    proposed: int = 0         # draft tokens proposed over the request
    accepted: int = 0         # of those, accepted
    verify_steps: int = 0


class Speculator:
    def __init__(self, method: str, max_tokens: int):
        if method != "ngram":
            raise ValueError(f"unknown speculative method {method!r}")
        self.method, self.max_tokens = method, max_tokens
        self.proposed = self.accepted = self.verify_steps = 0     # over every request, for /metrics

    def new_state(self) -> SpecState:
        return SpecState(k=self.max_tokens)

    def propose(self, state: SpecState, tokens: list[int], room: int) -> list[int]:
        """The draft for a sequence's next step: at most `room` tokens (what its max_tokens leaves after the token
        the step samples anyway)."""
        if state.pause:
            state.pause -= 1
            return []
        return state.index.propose(tokens, min(state.k, room)) if room > 0 else []

    def verified(self, state: SpecState, proposed: int, accepted: int) -> None:
        """A verify step accepted `accepted` of the `proposed` tokens."""
        state.proposed, state.accepted, state.verify_steps = (state.proposed + proposed, state.accepted + accepted,
                                                              state.verify_steps + 1)
        self.proposed, self.accepted, self.verify_steps = (self.proposed + proposed, self.accepted + accepted,
                                                           self.verify_steps + 1)
        if accepted == proposed:
            state.k, state.misses = min(self.max_tokens, state.k + 1), 0
        elif accepted:
            state.k, state.misses = accepted + 1, 0
        else:
            state.k, state.misses = 1, state.misses + 1
            state.pause = min(MAX_PAUSE, 2 ** state.misses)

    def stats(self) -> dict:
        return {"method": self.method, "proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
                "verify_steps": self.verify_steps}
