"""A request's grammar state (engine/grammar.py): its next mask is filled in a worker while the engine goes on."""
import copy
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import tokenizers
import torch

from kvtier.engine import grammar
from kvtier.engine.grammar import GrammarCompiler
from kvtier.models.tokenizer import _byte_level_tokens
from kvtier.server.agent_tools import responses_functions
from kvtier.server.tools import tool_call_grammar

LLMatcher, fill_next_token_bitmask = llguidance.LLMatcher, llguidance.numpy.fill_next_token_bitmask


class WatchedMatcher:
    """llguidance's matcher, refusing any use while a worker fills a mask with it, as llguidance itself refuses a
    use that overlaps a fill ("Already mutably borrowed")."""
    grammar_from_lark = staticmethod(LLMatcher.grammar_from_lark)

    def __init__(self, *args):
        self.matcher, self.filling = LLMatcher(*args), False

    def __getattr__(self, name):
        if self.filling:
            raise RuntimeError("Already mutably borrowed")
        return getattr(self.matcher, name)


class SlowFills:
    """The mask workers, each fill holding its matcher 20 ms, and `submit` returning once the fill holds it: the
    overlap that happened now and then, made certain."""

    def __init__(self):
        self.workers, self.holding = ThreadPoolExecutor(1), threading.Event()

    def submit(self, fn):
        self.holding.clear()
        future = self.workers.submit(fn)
        self.holding.wait()
        return future

    def fill(self, watched: WatchedMatcher, bitmask: np.ndarray, index: int) -> None:
        watched.filling = True
        self.holding.set()
        time.sleep(0.02)
        fill_next_token_bitmask(watched.matcher, bitmask, index)
        watched.filling = False


def test_a_grammar_is_never_asked_anything_while_its_next_mask_is_filled(monkeypatch, bundled_tokenizer):
    """The engine asks `done` right after each accepted token, while a worker fills the next mask: it once asked
    the matcher itself, and a request failed now and then (seen in a speculation test's run)."""
    monkeypatch.setattr(grammar.llguidance, "LLMatcher", WatchedMatcher)
    fills = SlowFills()
    monkeypatch.setattr(grammar, "MASK_WORKERS", fills)
    monkeypatch.setattr(grammar.llguidance.numpy, "fill_next_token_bitmask", fills.fill)
    hf = bundled_tokenizer.hf
    constraint = GrammarCompiler(hf).constraint('start: ("ab" | "cd")+ "."')
    words = [hf.encode(w) for w in ("ab", "cd", ".")]
    assert all(len(ids) == 1 for ids in words)
    logits = torch.zeros(hf.vocab_size)
    for i in range(10):
        token = words[i % 2][0]
        masked = constraint.masked(logits)
        assert masked[token] == 0 and torch.isinf(masked).sum() > hf.vocab_size // 2
        constraint.accept(token)
        assert not constraint.done
    constraint.masked(logits)
    constraint.accept(words[2][0])
    assert constraint.done


def test_a_mask_forbids_what_llguidances_own_helper_forbids():
    """`allowed` against llguidance's numpy helper over random masks, with logits past the mask's words (a model
    whose vocabulary rows outnumber its tokenizer's tokens): forbidden there too."""
    rng = np.random.default_rng(0)
    for vocab, rows in ((64, 64), (100, 120), (49152, 49280)):
        mask = rng.integers(-2**31, 2**31, size=(1, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        want = np.zeros((1, rows), dtype=np.float32)
        llguidance.numpy.apply_token_bitmask_inplace(want, mask)
        got = torch.zeros(rows).masked_fill(~grammar.allowed(mask[0], rows), float("-inf"))
        assert torch.equal(got, torch.from_numpy(want[0]))


def test_a_forced_call_reads_the_bundled_vocabulary_as_bytes(bundled_tokenizer):
    """llguidance's view of the bundled tokenizer decodes its byte-level tokens to the bytes they stand for ("Ċ" is
    a newline), whichever transformers converted it, and a tool call's opening tag with its newline is allowed."""
    hf = bundled_tokenizer.hf
    ll = llguidance.hf.from_tokenizer(hf)
    call = "<tool_call>\n{\"a\": 1}\n</tool_call>"
    assert ll.decode_bytes(hf.encode(call)) == call.encode()
    constraint = GrammarCompiler(hf).constraint('start: "<tool_call>\\n" "x"')
    for token in hf.encode("<tool_call>\nx"):
        constraint.masked(torch.zeros(hf.vocab_size))
        constraint.accept(token)
    assert constraint.done


def test_a_forced_freeform_call_writes_its_input_and_nothing_more(bundled_tokenizer):
    """A custom (freeform) tool is offered as a function of one string, `input`: a forced call's arguments are
    that key alone (a forced call once wrote keys after it until its tokens ran out)."""
    functions = responses_functions([{"type": "custom", "name": "apply_patch"}]).functions
    grammar = tool_call_grammar(functions, "hermes", parallel=False, tokens=bundled_tokenizer.added_tokens)
    call = '<tool_call>\n{"name":"apply_patch","arguments":{"input":"a"%s}}\n</tool_call>'
    assert writes(bundled_tokenizer.hf, grammar, call % "")
    assert not writes(bundled_tokenizer.hf, grammar, call % ',"type":"object"')


def writes(hf, grammar: str, text: str) -> bool:
    """Whether constrained decoding may write text, token by token as the tokenizer splits it."""
    constraint = GrammarCompiler(hf).constraint(grammar)
    for token in hf.encode(text):
        if constraint.masked(torch.zeros(len(hf)))[token] == float("-inf"):
            return False
        constraint.accept(token)
    return constraint.done


def test_a_byte_level_vocabulary_converted_as_byte_fallback_is_read_as_bytes(bundled_tokenizer):
    """transformers 5.17's conversion of the bundled GGUF: byte fallback on and sentencepiece's decoders before the
    byte-level one. kvtier's loader says the tokens are byte-level again: same ids, same text, and llguidance
    reads a newline where it read "Ċ"."""
    spec = json.loads(bundled_tokenizer.hf.backend_tokenizer.to_str())
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"},
                                                        {"type": "Replace", "pattern": {"String": "\u2581"},
                                                         "content": " "}, spec["decoder"]]}
    hf = copy.deepcopy(bundled_tokenizer.hf)
    hf._tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    text = "<tool_call>\nHéllo — 你好 🙂\t</tool_call>"
    assert llguidance.hf.from_tokenizer(hf).decode_bytes(hf.encode(text)) != text.encode()     # the bug, as it was
    _byte_level_tokens(hf)
    assert hf.encode(text) == bundled_tokenizer.hf.encode(text) and hf.decode(hf.encode(text)) == text
    assert llguidance.hf.from_tokenizer(hf).decode_bytes(hf.encode(text)) == text.encode()
