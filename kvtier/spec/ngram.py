"""Prompt lookup: the tokens that followed the last earlier occurrence of a sequence's own ending.

An editing agent repeats a file with a change, quotes a tool result, copies a JSON argument from its prompt: what
it writes next has usually been written before in the same context. `PromptLookup` finds the longest ending of the
sequence, LOOKUP_MIN to LOOKUP_MAX tokens (`--speculative-config`'s prompt_lookup_min and _max), that occurred
before, and proposes what followed its last earlier occurrence, copied on past the sequence's end as an overlapping
copy goes on (a loop the model has fallen into, a run of repeated separators or rows: a 2-token loop proposes k
tokens, not 2). One-token endings are right too rarely to pay for the
rows they add; an ending of 12 tokens picks the place a copy continues from where one of 5 often picks another
(measured on the editing workload: docs/BENCHMARKS.md).

It searches the sequence's tokens each step, with numpy, instead of keeping an index of every n-gram: an index of a
32K-token context took 15-50 MB of Python objects and 0.5-1 s of the engine thread to build when a request's first
decode step came, and each turn of a conversation is a new request. A search is a few passes over an int32 array:
tens of microseconds at 32K tokens.
"""
from __future__ import annotations

import numpy as np

LOOKUP_MIN = 2
LOOKUP_MAX = 12


class PromptLookup:
    def __init__(self, min_n: int = LOOKUP_MIN, max_n: int = LOOKUP_MAX):
        self.min_n, self.max_n = min_n, max_n
        self.tokens = np.empty(1024, dtype=np.int32)    # the sequence's tokens so far, in the first `length`
        self.length = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """k tokens that followed the last earlier occurrence of tokens' longest matching ending (none without one)."""
        t = self._grown(tokens)
        n, m = len(t), self.min_n
        if n <= m:
            return []
        # ends e (exclusive) of earlier windows, m <= e < n, whose last m tokens are the sequence's last m
        same = np.ones(n - m, dtype=bool)
        for j in range(1, m + 1):
            same &= t[m - j:n - j] == t[n - j]
        ends = np.flatnonzero(same) + m
        # longer endings: of the windows that match j - 1 tokens, those whose j-th token back matches too
        for j in range(m + 1, min(self.max_n, n - 1) + 1):
            longer = ends[ends >= j]
            longer = longer[t[longer - j] == t[n - j]]
            if not len(longer):
                break
            ends = longer
        if not len(ends):
            return []
        # what followed, copied on past the sequence's end as from its own copy (LZ77's overlapping copy): an ending
        # that last occurred p tokens back repeats with period p, so the proposal goes on repeating those p tokens
        end = int(ends[-1])
        return np.resize(t[end:end + k], k).tolist()

    def _grown(self, tokens: list[int]) -> np.ndarray:
        """The sequence's tokens as an array, appending those added since the last call (a sequence only grows)."""
        n = len(tokens)
        if n > len(self.tokens):
            self.tokens = np.resize(self.tokens, max(n, 2 * len(self.tokens)))
        if n > self.length:
            self.tokens[self.length:n] = tokens[self.length:]
            self.length = n
        return self.tokens[:n]
