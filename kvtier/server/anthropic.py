"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its request becomes a
chat request (so tools, templates, grammars and the KV cache are shared with the OpenAI routes), and the
engine's outputs become Anthropic messages and stream events."""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Annotated, Literal

import xxhash
from pydantic import BaseModel, Field, ValidationError

from kvtier.engine.outputs import RequestOutput
from kvtier.server.agent_tools import anthropic_functions
from kvtier.server.protocol import APIError, ChatCompletionRequest, KvtierOptions, RequestModel
from kvtier.server.reasoning import ReplyReader
from kvtier.server.render import Renderer
from kvtier.server.tool_parsers import ToolCall

log = logging.getLogger("kvtier.server")

# Claude Code's first system block is billing metadata for Anthropic's servers, not words for the model, and
# some versions change it in every request (a `cch=` hash): left out, so it never splits the cached prefix
BILLING_HEADER = "x-anthropic-billing-header:"

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# ---------------------------------------------------------------- requests

class ContentBlock(BaseModel, extra="allow"):
    """A block of the conversation. Clients send back the blocks they were given, with every key the
    client library knows (ids of callers, citations...): history, not instructions, so extra keys pass."""


class TextBlock(ContentBlock):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None      # every prefix is cached anyway
    citations: list | None = None


class ToolUseBlock(ContentBlock):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(ContentBlock):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(ContentBlock):         # earlier turns' thinking: rendered as the chat template wants
    cache_control: dict | None = None
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class HostedBlock(ContentBlock):
    """A server tool's call or result (web search, code execution, MCP...): kvtier ran none, so the history's
    are left out of the prompt."""
    type: Literal["server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "mcp_tool_use",
                  "mcp_tool_result", "container_upload", "tool_search_tool_result"]
    cache_control: dict | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | HostedBlock,
                  Field(discriminator="type")]


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]     # a system message may stand anywhere, as templates allow
    content: str | list[Block]

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    """Switches a reasoning model's thinking (the template's enable_thinking); budget_tokens is a hint."""
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputConfig(RequestModel):
    effort: str | None = None              # a hint: kvtier does not budget the model's tokens
    format: dict | None = None             # {"type": "json_schema", "schema": ...}: the reply matches the schema


class CountTokensRequest(RequestModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict] | None = None        # sorted by agent_tools.anthropic_functions
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: dict | None = None      # the older name of output_config.format
    # hints, accepted and not used (see the README's table of request fields)
    context_management: dict | None = None     # kvtier keeps the context as sent: it clears nothing
    mcp_servers: list[dict] | None = None      # MCP connectors the server would run: left out, logged
    container: str | dict | None = None
    service_tier: str | None = None
    inference_geo: str | None = None

    def to_chat(self, **sampling) -> tuple[ChatCompletionRequest, int]:
        """The same conversation as an OpenAI chat request (tool results become tool messages, tool uses
        assistant tool calls, thinking blocks are dropped), and how many of its messages reach through the
        last cache_control breakpoint (0 if none)."""
        messages = []
        functions = anthropic_functions(self.tools or [])
        hosted = functions.hosted + [f"mcp_servers[{i}]" for i in range(len(self.mcp_servers or []))]
        if hosted:
            log.info("hosted tools left out of the prompt (kvtier runs none): %s", ", ".join(hosted))
        marked = int(any(t.get("cache_control") for t in self.tools or []))   # tools come before the messages
        if self.system:
            system = self.system if isinstance(self.system, str) else \
                "\n".join(b.text for b in self.system if not b.text.startswith(BILLING_HEADER))
            messages.append({"role": "system", "content": system})
            marked = max(marked, int(not isinstance(self.system, str) and any(b.cache_control for b in self.system)))
        for message in self.messages:
            blocks = message.blocks()
            texts = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
            if message.role == "system":
                messages.append({"role": "system", "content": texts})
            elif message.role == "user":
                messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                             for b in blocks if isinstance(b, ToolResultBlock)]
                if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    messages.append({"role": "user", "content": texts})
            else:
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in blocks if isinstance(b, ToolUseBlock)]
                thinking = "\n".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock) and b.thinking)
                messages.append({"role": "assistant", "content": texts or None,
                                 **({"reasoning_content": thinking} if thinking else {}),
                                 **({"tool_calls": calls} if calls else {})})
            if any(b.cache_control for b in message.blocks() if not isinstance(b, ThinkingBlock)):
                marked = len(messages)
        tools = [{"type": "function", "function": f} for f in functions.functions] or None
        switch = {} if self.thinking is None else \
            {"chat_template_kwargs": {"enable_thinking": self.thinking.type != "disabled"}}
        try:
            return ChatCompletionRequest(model=self.model, messages=messages, tools=tools, **self._tool_choice(),
                                         **self._response_format(), **switch, **sampling), marked
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise APIError(400, f"the conversation cannot be served: {problems}") from None

    def _response_format(self) -> dict:
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        if fmt is None:
            return {}
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                           param="output_config")
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}

    def _tool_choice(self) -> dict:
        choice = self.tool_choice
        if choice is None:
            return {}
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice")
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        return {"tool_choice": mapped, "parallel_tool_calls": False if choice.disable_parallel_tool_use else None}


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict | None = None           # user_id for the caller's records: accepted, not used
    cache_control: dict | None = None      # automatic prompt caching: kvtier caches every prefix anyway
    kvtier: KvtierOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def to_chat(self, **sampling) -> tuple[ChatCompletionRequest, int]:
        return super().to_chat(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, stream=self.stream, kvtier=self.kvtier,
                               cache_salt=self.cache_salt, **sampling)


# ---------------------------------------------------------------- responses

class MessageUsage(BaseModel):
    input_tokens: int                      # computed, not read from the cache
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, out: RequestOutput) -> MessageUsage:
        return cls(input_tokens=out.num_prompt_tokens - out.num_cached_tokens, output_tokens=out.num_output_tokens,
                   cache_read_input_tokens=out.num_cached_tokens)


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class MessagesRenderer(Renderer):
    """Anthropic's shapes. Streams: message_start, then per content block (thinking, text, or a tool use once
    its call is complete) content_block_start / _delta / _stop, then message_delta and message_stop."""
    id_prefix = "msg_"

    def __init__(self, model: str, token_str: Callable[[int], str], reader: ReplyReader):
        super().__init__(model, token_str)
        self.reader = reader
        self.started = False
        self.num_blocks = 0
        self.open_block: str | None = None    # "thinking" or "text" while one streams
        self.thinking = ""                    # what the open thinking block holds, for its signature
        self.called = False

    def response(self, out: RequestOutput) -> MessageResponse:
        reply = self.reader.read(out.new_text)
        text, calls = reply.content, reply.calls
        thinking = [{"type": "thinking", "thinking": reply.reasoning, "signature": signature(reply.reasoning)}] \
            if reply.reasoning else []
        content = thinking + ([{"type": "text", "text": text}] if text else []) + [_tool_use(call) for call in calls]
        return MessageResponse(id=self.id, model=self.model, content=content, usage=MessageUsage.of(out),
                               stop_reason=self._stop_reason(out, bool(calls)),
                               stop_sequence=out.stop_string)

    def events(self, out: RequestOutput) -> list[str]:
        events = []
        if not self.started:
            self.started = True
            usage = MessageUsage.of(out).model_dump() | {"output_tokens": 0}
            events.append(_event("message_start", {"message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}}))
        reply = self.reader.feed(out.new_text, final=out.finished)
        if reply.reasoning:
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += reply.reasoning
            events.append(_event("content_block_delta", {"index": self.num_blocks - 1, "delta": {
                "type": "thinking_delta", "thinking": reply.reasoning}}))
        if reply.content:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(_event("content_block_delta", {"index": self.num_blocks - 1,
                                                         "delta": {"type": "text_delta", "text": reply.content}}))
        for call in reply.calls:
            events += self._close()
            use = _tool_use(call)
            events.append(self._start_block({**use, "input": {}}))
            events.append(_event("content_block_delta", {"index": self.num_blocks - 1, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
            events.append(_event("content_block_stop", {"index": self.num_blocks - 1}))
            self.called = True
        return events

    def closing_events(self, last: RequestOutput) -> list[str]:
        return self._close() + [
            _event("message_delta", {"delta": {"stop_reason": self._stop_reason(last, self.called),
                                               "stop_sequence": last.stop_string},
                                     "usage": {"output_tokens": last.num_output_tokens}}),
            _event("message_stop", {})]

    def error_events(self, message: str) -> list[str]:
        return [_event("error", error_body(500, message))]

    def _start_block(self, block: dict) -> str:
        self.num_blocks += 1
        return _event("content_block_start", {"index": self.num_blocks - 1, "content_block": block})

    def _open(self, kind: str, block: dict) -> list[str]:
        """The events that make a block of this kind the open one (none if it already is)."""
        if self.open_block == kind:
            return []
        events = self._close() + [self._start_block(block)]
        self.open_block = kind
        return events

    def _close(self) -> list[str]:
        """The events that close the open block; a thinking block gets its signature first."""
        kind, self.open_block = self.open_block, None
        if kind is None:
            return []
        events = []
        if kind == "thinking":
            events.append(_event("content_block_delta", {"index": self.num_blocks - 1, "delta": {
                "type": "signature_delta", "signature": signature(self.thinking)}}))
            self.thinking = ""
        return events + [_event("content_block_stop", {"index": self.num_blocks - 1})]

    @staticmethod
    def _stop_reason(out: RequestOutput, called: bool) -> str | None:
        if out.finish_reason == "length":
            return "max_tokens"
        if called:
            return "tool_use"
        return "stop_sequence" if out.stop_string else "end_turn"


def signature(thinking: str) -> str:
    """The signature clients expect on a thinking block and send back with it. kvtier checks nothing with it
    (a thinking block in the history is rendered as the chat template wants): a digest of the text."""
    return xxhash.xxh3_128_hexdigest(thinking.encode())


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
            "input": json.loads(call.arguments)}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
