"""Constrained decoding with llguidance: a request's grammar masks its logits token by token.

llguidance was chosen over xgrammar because it installs as one wheel with no dependencies (xgrammar
pulls triton and a TVM runtime onto CPU machines), compiles a grammar in milliseconds, and takes Lark
grammars with JSON schemas embedded, which is what a forced tool call in a tagged format needs. Only
constrained sequences build a matcher; the others never touch this module. A sequence's next mask is
computed in a worker thread as soon as its token is accepted (llguidance releases the GIL), so it is
ready by the next step's sampling and the step does not wait for it. The mask is filled with llguidance's numpy
helpers and applied here: llguidance.torch compiles its kernel with torch.compile, which costs every process 3.4 s
to import (torch's compiler) and needs a C++ compiler at run time.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch


MASK_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-grammar")


class GrammarError(ValueError):
    """A grammar (or the JSON schema inside it) that cannot be compiled."""


class GrammarCompiler:
    """Makes a Constraint per request; the tokenizer view llguidance needs is built once, on first use."""

    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None

    def constraint(self, grammar: str) -> Constraint:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer)
        matcher = llguidance.LLMatcher(self._tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self._tokenizer.vocab_size)


class Constraint:
    """One sequence's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)     # a bit per token, 1: allowed
        # the grammar is complete and allows nothing more (end-of-sequence aside): read from the matcher only here
        # and in accept, never while a worker fills its next mask (llguidance refuses a matcher in use elsewhere)
        self.done = matcher.is_stopped()
        self._next_mask: Future = MASK_WORKERS.submit(self._fill)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [vocab] with every token the grammar forbids at -inf (a new tensor)."""
        self._next_mask.result()
        return logits.masked_fill(~allowed(self.bitmask[0], logits.shape[-1]).to(logits.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        self._next_mask.result()        # the mask for this token was used; its fill is over
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} breaks the grammar: {self.matcher.get_error()}")
        self.done = self.matcher.is_stopped()
        if not self.done:
            self._next_mask = MASK_WORKERS.submit(self._fill)     # ready by the next step

    def _fill(self) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask, 0)


BITS = torch.arange(32, dtype=torch.int32)


def allowed(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """The tokens a bitmask (int32 words, token i at bit i % 32 of word i // 32) allows, as bools [vocab_size]:
    tokens past the mask's words (logits rows past the tokenizer's vocabulary) are not allowed."""
    bits = (torch.from_numpy(bitmask).unsqueeze(-1) >> BITS & 1).view(-1).bool()
    return torch.cat([bits, bits.new_zeros(max(0, vocab_size - bits.numel()))])[:vocab_size]

