"""Scripted replies, for tests only: with $KVTIER_TEST_SCRIPT naming a JSON file, chat replies are forced by
constrained decoding to the text of the first rule that fits, so a random-weight model drives a real agent's
tool loop. The model still computes every prompt and every token; only its choice of tokens is constrained.

The file is a list of rules, {"tool": NAME, "reply": TEXT} or {"reply": TEXT}. A rule with a tool fits a
request that offers that tool and whose turn has called no tool yet (no tool result since the assistant last
answered in words); a rule without one fits any request."""
from __future__ import annotations

import json
import logging
import os

from kvtier.server.tools import lark_text

log = logging.getLogger("kvtier.server")

ENV = "KVTIER_TEST_SCRIPT"


class ScriptedReplies:
    def __init__(self, rules: list[dict]):
        if not isinstance(rules, list) or not all(isinstance(r, dict) and isinstance(r.get("reply"), str)
                                                  for r in rules):
            raise ValueError(f"${ENV} must name a JSON list of {{'reply': TEXT, 'tool'?: NAME}} rules")
        self.rules = rules

    @classmethod
    def from_environment(cls) -> ScriptedReplies | None:
        path = os.environ.get(ENV)
        if not path:
            return None
        with open(path) as f:
            script = cls(json.load(f))
        log.warning("replies are scripted by %s (a test switch: never serve users with it)", path)
        return script

    def grammar(self, messages: list[dict], tools: list[str], tokens: frozenset[str]) -> str | None:
        """The grammar that writes the fitting rule's reply (tokens: the tokenizer's added tokens), or None if
        no rule fits."""
        turn = messages
        for i, message in enumerate(messages):
            if message["role"] == "assistant" and not message.get("tool_calls"):
                turn = messages[i + 1:]
        called = any(message["role"] == "tool" for message in turn)
        for rule in self.rules:
            if "tool" not in rule or (rule["tool"] in tools and not called):
                return f"start: {lark_text(rule['reply'], tokens)}"
        return None
