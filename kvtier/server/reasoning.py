"""A reply's text split into reasoning, content and tool calls, whole or as it streams.

Reasoning models write their thoughts between `<think>` and `</think>`. Two formats, chosen from the chat
template (`--reasoning-parser` overrides):
- `qwen3`: the model opens its own `<think>` block; a reply that does not open one is all content (Qwen3 with
  thinking switched off, whose template writes an empty block into the prompt).
- `deepseek_r1`: the template opens the block in the prompt, so the reply starts inside it and everything up
  to `</think>` is reasoning (DeepSeek-R1, Qwen3 thinking-only models).
Either way a prompt that ends inside an open block starts the reply in it, and one that ends right after a
closed block starts it in the content. Content then goes through the tool parser.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.server.tool_parsers import ToolCall, ToolParser, partial_suffix

START, END = "<think>", "</think>"


def reasoning_parser_for_template(template: str | None, generation_prompt: str) -> str | None:
    """The format a chat template's thinking calls for: None without one, deepseek_r1 when its generation
    prompt (rendered by the caller) opens the block, else qwen3."""
    if not template or START not in template:
        return None
    return "deepseek_r1" if generation_prompt.rstrip().endswith(START) else "qwen3"


def starts_inside(parser: str, prompt_tail: str) -> bool | None:
    """Whether a reply to a prompt ending in prompt_tail starts inside the reasoning block: True, False, or
    None when its first characters decide (a qwen3 model may open a block)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(START):
        return True
    if tail.endswith(END):
        return False
    return True if parser == "deepseek_r1" else None


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ReplyReader:
    """Reads one reply: feed() takes text deltas and releases what can no longer change; read() takes it whole.
    inside: as starts_inside() says (ignored without reasoning); tools: the tool parser, or None."""

    def __init__(self, reasoning: bool, inside: bool | None, tools: ToolParser | None):
        self.state = "content" if not reasoning else {True: "reasoning", False: "content", None: "undecided"}[inside]
        self.pending = ""            # text not released yet: a tag's possible beginning
        self.released_reasoning = False
        self.after_block = False
        self.tools = tools.streamer() if tools else None

    def read(self, text: str) -> Reply:
        return self.feed(text, final=True)

    def feed(self, delta: str, final: bool = False) -> Reply:
        self.pending += delta
        reasoning, content = "", ""
        if self.state == "undecided":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.pending, self.state = head[len(START):], "reasoning"
            elif final or not START.startswith(head):
                self.state = "content"
        if self.state == "reasoning":
            if not self.released_reasoning:       # the newline after <think> is the tag's, not the thought's
                self.pending = self.pending.lstrip("\n")
            end = self.pending.find(END)
            if end >= 0:
                reasoning, self.pending = self.pending[:end].rstrip("\n"), self.pending[end + len(END):]
                self.state, self.after_block = "content", True
            else:   # hold back a possible </think> and the newlines that may stand before it
                keep = 0 if final else partial_suffix(self.pending, END)
                before = self.pending[:len(self.pending) - keep]
                keep += 0 if final else len(before) - len(before.rstrip("\n"))
                reasoning, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            self.released_reasoning |= bool(reasoning)
        if self.state == "content":
            if self.after_block:              # so are the newlines after </think>
                self.pending = self.pending.lstrip("\n")
                self.after_block = not self.pending
            content, self.pending = self.pending, ""
        calls = []
        if self.tools is not None and (content or final):
            content, calls = self.tools.feed(content, final=final)
        return Reply(reasoning, content, calls)
