"""Tool calls out of a model's text, whole or as it streams.

Two formats, chosen per model family (`--tool-call-parser` overrides):
- `hermes` (Hermes, Qwen 2.5/3, and kvtier's generic rendering): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text around the calls is content.
- `llama3_json` (Llama 3.1+): the whole reply is one JSON object `{"name": ..., "parameters": {...}}`,
  or several separated by `;`.
A call that does not parse stays in the content as the model wrote it: never an error.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON object, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    """A call from one JSON object with a string name and object arguments; None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):     # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls): the calls that parse are taken out of the text."""
        return self.streamer().feed(text, final=True)

    def streamer(self) -> HermesStreamer:
        return HermesStreamer(self)


class HermesStreamer:
    """Feeds on text deltas; releases content that can no longer be part of a call, and each call once its
    closing tag has arrived."""

    def __init__(self, parser: HermesParser):
        self.parser = parser
        self.pending = ""        # text not released yet: a possible tag start, or an open call
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += delta
        pieces, calls = [], []
        while True:
            start = self.pending.find(HermesParser.START)
            if start < 0:
                keep = 0 if final else partial_suffix(self.pending, HermesParser.START)
                pieces.append(self._content(self.pending[:len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep:]
                break
            pieces.append(self._content(self.pending[:start]))
            self.pending = self.pending[start:]
            end = self.pending.find(HermesParser.END)
            if end < 0:
                if final:                        # cut off inside a call: what was written is content
                    pieces.append(self.pending)
                    self.pending = ""
                break
            block = self.pending[:end + len(HermesParser.END)]
            self.pending = self.pending[len(block):]
            call = _call_from_json(block[len(HermesParser.START):-len(HermesParser.END)].strip(), "arguments")
            if call is None:
                pieces.append(block)
            else:
                calls.append(call)
                self.num_calls += 1
        return "".join(pieces), calls

    def _content(self, text: str) -> str:
        """Text outside calls; once a call was made, the whitespace between calls is not content."""
        return "" if self.num_calls and not text.strip() else text


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        stripped = text.strip()
        if not stripped.startswith("{"):
            return text, []
        calls = [_call_from_json(part, "parameters") for part in _split_objects(stripped)]
        if not calls or None in calls:
            return text, []
        return "", calls

    def streamer(self) -> Llama3JsonStreamer:
        return Llama3JsonStreamer(self)


class Llama3JsonStreamer:
    """A reply that starts with '{' may be calls: it is held back until the end, then parsed whole."""

    def __init__(self, parser: Llama3JsonParser):
        self.parser = parser
        self.text = ""
        self.holding = None      # None until the first non-space character decides

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.holding is None and self.text.strip():
            self.holding = self.text.lstrip().startswith("{")
        if self.holding is False:
            released, self.text = self.text, ""
            return released, []
        if not final:
            return "", []
        text, self.text = self.text, ""
        return self.parser.parse(text)


def _split_objects(text: str) -> list[str]:
    """'{...}; {...}' → the objects' texts (a ';' inside a string does not split)."""
    parts, depth, in_string, escaped, start = [], 0, False, False, 0
    for i, c in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
            continue
        if c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ";" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper beginning of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


ToolParser = HermesParser | Llama3JsonParser
PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser())}


def parser_for_template(template: str | None) -> ToolParser:
    """The parser a chat template's own tool format calls for; Hermes for templates without one (kvtier's
    generic tool rendering writes Hermes calls)."""
    if template and "<|python_tag|>" in template:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
