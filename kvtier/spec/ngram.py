"""Prompt lookup: the tokens that followed the last earlier occurrence of a sequence's own ending.

An editing agent repeats a file with a change, quotes a tool result, copies a JSON argument from its prompt: what
it writes next has usually been written before in the same context. `NgramIndex` keeps, for every n-gram of the
sequence (min_n to max_n tokens: `--speculative-config`'s prompt_lookup_min and _max, 2 and 5 by default: one-token
matches are right too rarely to pay for the rows they add), where it last ended, adding only the tokens appended
since the last call, and proposes what followed the longest n-gram that ends the sequence and occurred before.
"""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int = 2, max_n: int = 5):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}     # n-gram → where its last occurrence so far ended
        self.indexed = 0                                # n-grams ending at or before this position are in

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the last earlier occurrence of tokens' longest matching ending."""
        length = len(tokens)
        # the n-grams ending before the last token: the ending itself is not an earlier occurrence of itself
        for end in range(max(self.indexed + 1, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []
