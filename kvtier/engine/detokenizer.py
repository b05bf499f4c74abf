"""Incremental detokenization with stop strings.

Text is released only once it is final: never half a UTF-8 character, never the start of
what might become a stop string.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""            # all output text decoded so far (stop string cut once found)
        self.num_released = 0     # characters of `text` already handed to the caller
        self.matched_stop: str | None = None   # the stop string that ended the text
        self.prefix_offset = 0    # token window used to decode the next piece in context
        self.read_offset = 0

    def add_token(self, token_id: int) -> bool:
        """Append one token; True when a stop string now appears (text is cut before it)."""
        self.token_ids.append(token_id)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = max(0, len(self.text) - self.hold_back)  # a stop may begin in held-back text
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return self._cut_at_stop(start)
        return False

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            at, self.matched_stop = min(hits)
            self.text = self.text[:at]
            return True
        return False

    def release(self, finished: bool) -> str:
        """Text that is final now; everything left when the request finishes."""
        end = len(self.text) if finished else max(self.num_released, len(self.text) - self.hold_back)
        piece = self.text[self.num_released:end]
        self.num_released = end
        return piece
