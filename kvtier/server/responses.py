"""The OpenAI Responses API (`POST /v1/responses`): its input items become a chat request (so tools,
templates, grammars and the KV cache are shared with chat completions), the engine's outputs become
response output items and stream events, and recent responses are kept (ResponseStore) so that a client
continues a conversation by `previous_response_id`, restoring its KV from the tiers."""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from kvtier.engine.outputs import RequestOutput
from kvtier.kv.tiers.files import atomic_write, read_regular, regular_files, remove
from kvtier.server.protocol import APIError, ChatCompletionRequest, KvtierOptions, OpenAIHints, RequestModel
from kvtier.server.agent_tools import HOSTED_CALLS, FunctionSet, responses_functions
from kvtier.server.reasoning import ReplyReader
from kvtier.server.render import Renderer
from kvtier.server.tool_parsers import ToolCall

log = logging.getLogger("kvtier.server")

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "reasoning_text", "summary_text", "refusal"})
MAX_IN_MEMORY = 1024
MAX_FILES = 4096


# ---------------------------------------------------------------- requests

class InputItem(BaseModel, extra="allow"):
    """An item of the conversation; clients send back output items with every key they were given (ids,
    statuses, encrypted content), so extra keys pass."""
    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    input: str | None = None              # a custom tool's call
    output: str | list[dict] | None = None
    summary: list[dict] | None = None     # a reasoning item's


class NamedTool(RequestModel):
    type: Literal["function", "custom"]
    name: str


class AllowedTools(RequestModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict]


class TextFormat(RequestModel, populate_by_name=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None          # a hint: kvtier writes what the model writes


class ReasoningOptions(RequestModel):
    effort: str | None = None             # "none" switches a reasoning model's thinking off, others on
    summary: str | None = None            # hints: the reasoning comes whole, as reasoning text
    generate_summary: str | None = None


class ResponsesRequest(OpenAIHints):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict] | None = None       # sorted by agent_tools.responses_functions
    tool_choice: Literal["none", "auto", "required"] | NamedTool | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: dict | None = None    # include_obfuscation: a hint, nothing is padded
    previous_response_id: str | None = None
    store: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict | None = None          # the caller's labels: echoed back, not used
    # more hints and metadata, accepted and not used
    user: str | None = None
    client_metadata: dict | None = None
    include: list[str] | None = None      # reasoning comes as text; nothing is encrypted
    truncation: Literal["disabled", "auto"] | None = None   # kvtier never drops input: too long is a 400
    background: Literal[False] | None = None
    top_logprobs: Literal[0] | None = None
    kvtier: KvtierOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @property
    def functions(self) -> FunctionSet:
        return responses_functions(self.tools or [])

    def messages(self) -> list[dict]:
        """The input items as chat messages (without the instructions, which never carry over)."""
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages: list[dict] = []
        reasoning = ""            # a reasoning item goes with the assistant message that follows it
        for index, item in enumerate(items):
            if item.type == "message":
                if item.role == "assistant":
                    messages.append(_assistant(reasoning, _text(item.content, f"input[{index}].content")))
                    reasoning = ""
                else:
                    messages.append({"role": "system" if item.role == "developer" else item.role or "user",
                                     "content": _text(item.content, f"input[{index}].content")})
            elif item.type in ("function_call", "custom_tool_call"):
                arguments = item.arguments or "{}" if item.type == "function_call" else json.dumps({"input": item.input})
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
                if messages and messages[-1]["role"] == "assistant" and not reasoning:   # parallel calls share one
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({**_assistant(reasoning, None), "tool_calls": [call]})
                    reasoning = ""
            elif item.type in ("function_call_output", "custom_tool_call_output"):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _text(item.output, f"input[{index}].output")})
            elif item.type == "reasoning":
                reasoning += _text(item.content, f"input[{index}].content") or \
                    "\n".join(part.get("text", "") for part in item.summary or [])
            elif item.type not in HOSTED_CALLS:       # a hosted tool's call kvtier never made: left out
                raise APIError(400, f"input[{index}]: items of type '{item.type}' are not supported", param="input")
        return messages

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        functions = self.functions
        if functions.hosted:
            log.info("hosted tools left out of the prompt (kvtier runs none): %s", ", ".join(functions.hosted))
        tools = [{"type": "function", "function": f} for f in functions.functions] or None
        choice = self.tool_choice
        if isinstance(choice, NamedTool):
            choice = {"type": "function", "function": {"name": choice.name}}
        elif isinstance(choice, AllowedTools):
            raise APIError(400, "tool_choice of type allowed_tools is not supported; send the allowed tools "
                                "as tools", param="tool_choice")
        fmt = self.text.format if self.text else None
        response_format = None if fmt is None else {"type": fmt.type, **(
            {"json_schema": {"name": fmt.name or "output", "schema": fmt.json_schema}} if fmt.type == "json_schema"
            else {})}
        effort = self.reasoning.effort if self.reasoning else None
        try:
            return ChatCompletionRequest(
                model=self.model, messages=system + history + self.messages(), tools=tools, tool_choice=choice,
                parallel_tool_calls=self.parallel_tool_calls, max_tokens=self.max_output_tokens,
                temperature=self.temperature, top_p=self.top_p, stream=self.stream, response_format=response_format,
                reasoning_effort=effort, kvtier=self.kvtier, cache_salt=self.cache_salt)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise APIError(400, f"the input cannot be served: {problems}", param="input") from None


def _assistant(reasoning: str, content: str | None) -> dict:
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


def _text(content, where: str) -> str:
    """Text of a message's content or a call's output: a string, or parts with text (a part that holds
    something else, an image say, is a 400 naming it: kvtier serves text models)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{i}]: parts of type '{kind}' are not supported (kvtier serves "
                                "text models)", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


# ---------------------------------------------------------------- responses

class ResponsesRenderer(Renderer):
    """Response objects and the Responses stream: response.created, then per output item (reasoning, a
    message, or a function call once complete) its added / delta / done events, then response.completed.
    on_done gets the output as chat messages, for the store."""
    id_prefix = "resp_"
    # Codex's stream watchdog (300 s) counts events, not comments, from the answer on: a Responses stream answers with
    # its first output, which sends response.created, as it did
    answers_early = False

    def __init__(self, model: str, token_str: Callable[[int], str], body: ResponsesRequest, reader: ReplyReader,
                 on_done: Callable[[str, list[dict]], None] | None):
        super().__init__(model, token_str)
        self.body, self.reader, self.on_done = body, reader, on_done
        self.sequence = 0
        self.items: list[dict] = []         # output items so far (the open item's text grows)
        self.open_item: dict | None = None  # the reasoning or message item streaming now
        self.freeform = body.functions.freeform
        self.calls_left = 1 if body.parallel_tool_calls is False else body.max_tool_calls or 2**31

    def response(self, out: RequestOutput) -> BaseModel:
        reply = self.reader.read(out.new_text)
        self.items = ([_reasoning_item(reply.reasoning)] if reply.reasoning else []) + \
            ([_message_item(reply.content)] if reply.content else []) + \
            [self._call_item(call) for call in self._allowed(reply)]
        return Response(**self._object(out, "completed" if out.finish_reason != "length" else "incomplete"))

    def events(self, out: RequestOutput) -> list[str]:
        events = []
        if self.sequence == 0:
            start = self._object(out, "in_progress", usage=False)
            events += [self._event("response.created", response=start),
                       self._event("response.in_progress", response=start)]
        reply = self.reader.feed(out.new_text, final=out.finished)
        for kind, text in (("reasoning", reply.reasoning), ("message", reply.content)):
            if text:
                events += self._open(kind)
                item = self.open_item
                item["content"][0]["text"] += text
                delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
                events.append(self._event(delta, item_id=item["id"], output_index=len(self.items) - 1,
                                          content_index=0, delta=text))
        for call in self._allowed(reply):
            events += self._close()
            item = self._call_item(call)
            self.items.append(item)
            index = len(self.items) - 1
            if item["type"] == "custom_tool_call":
                argument, stage = "input", "response.custom_tool_call_input"
            else:
                argument, stage = "arguments", "response.function_call_arguments"
            events += [self._event("response.output_item.added", output_index=index, item={**item, argument: ""}),
                       self._event(f"{stage}.delta", item_id=item["id"], output_index=index, delta=item[argument]),
                       self._event(f"{stage}.done", item_id=item["id"], output_index=index,
                                   **{argument: item[argument]}),
                       self._event("response.output_item.done", output_index=index, item=item)]
        return events

    def _allowed(self, reply) -> list[ToolCall]:
        """The reply's calls within max_tool_calls (one without parallel calls)."""
        calls = reply.calls[:self.calls_left]
        self.calls_left -= len(calls)
        return calls

    def _call_item(self, call: ToolCall) -> dict:
        item = {"id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name, "status": "completed"}
        if call.name in self.freeform:
            return {"type": "custom_tool_call", **item, "input": str(json.loads(call.arguments).get("input", ""))}
        return {"type": "function_call", **item, "arguments": call.arguments}

    def closing_events(self, last: RequestOutput) -> list[str]:
        status = "completed" if last.finish_reason != "length" else "incomplete"
        return self._close() + [self._event(f"response.{status}", response=self._object(last, status))]

    def error_events(self, message: str) -> list[str]:
        return [self._event("error", code="server_error", message=message, param=None)]

    def _open(self, kind: str) -> list[str]:
        """The events that make an item of this kind the open one (none if it already is)."""
        if self.open_item is not None and self.open_item["type"] == kind:
            return []
        events = self._close()
        self.open_item = _message_item("", status="in_progress") if kind == "message" else _reasoning_item("")
        self.items.append(self.open_item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=self.open_item))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=self.open_item["id"],
                                      output_index=index, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[str]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        if item["type"] == "reasoning":
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        item["status"] = "completed"
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _object(self, out: RequestOutput, status: str, usage: bool = True) -> dict:
        """The response object; a finished one is handed to the store."""
        body = self.body
        if status != "in_progress" and self.on_done is not None:
            self.on_done(self.id, _as_messages(self.items))
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "output": self.items if status != "in_progress" else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": body.instructions, "metadata": body.metadata or {},
            "previous_response_id": body.previous_response_id,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
            else body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "store": body.store is not False, "truncation": "disabled", "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": out.num_prompt_tokens,
                      "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                      "output_tokens": out.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": out.num_prompt_tokens + out.num_output_tokens} if usage else None}

    def _event(self, kind: str, **data) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence, **data})}\n\n"


class Response(BaseModel, extra="allow"):
    id: str
    object: Literal["response"]


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _as_messages(items: list[dict]) -> list[dict]:
    """Output items as the chat messages a continuation renders."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    reasoning = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
    calls = [{"id": i["call_id"], "type": "function", "function": {
        "name": i["name"], "arguments": i["arguments"] if "arguments" in i else json.dumps({"input": i["input"]})}}
        for i in items if i["type"] in ("function_call", "custom_tool_call")]
    return [{"role": "assistant", "content": text or None, **({"reasoning_content": reasoning} if reasoning else {}),
             **({"tool_calls": calls} if calls else {})}]


# ---------------------------------------------------------------- the store

class ResponseStore:
    """Recent responses' conversations (chat messages, instructions left out), by response id: the newest
    MAX_IN_MEMORY in memory, and with a directory the newest MAX_FILES as JSON files (mode 0600) that
    outlive a restart, written by a worker thread of their own. Thread-safe."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._memory: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                log.warning("responses are kept in memory only: %s", e)
                self.directory = None
        if self.directory is not None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-responses")

    def put(self, response_id: str, messages: list[dict]) -> None:
        """Keep a conversation: in memory at once, on disk from the writer thread (the caller is the server's
        event loop, which a write and its fsync must not stall)."""
        with self._lock:
            self._memory[response_id] = messages
            self._memory.move_to_end(response_id)
            while len(self._memory) > MAX_IN_MEMORY:
                self._memory.popitem(last=False)
        if self._writer is not None:
            self._writer.submit(self._write, response_id, messages)

    def flush(self) -> None:
        """Wait until what was put so far is on disk."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def _write(self, response_id: str, messages: list[dict]) -> None:
        try:
            atomic_write(self._path(response_id), [json.dumps(messages).encode()])
            self._trim()
        except OSError as e:
            log.warning("could not keep response %s on disk: %s", response_id, e)

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            if response_id in self._memory:
                self._memory.move_to_end(response_id)
                return self._memory[response_id]
        if self.directory is None or not response_id.replace("_", "").isalnum():
            return None
        try:
            messages = json.loads(read_regular(self._path(response_id)))
        except (OSError, ValueError):      # absent, or damaged: a miss
            return None
        return messages if isinstance(messages, list) else None

    def _trim(self) -> None:
        files, _ = regular_files(self.directory)
        if len(files) > MAX_FILES:
            files.sort(key=lambda entry: entry.stat().st_mtime)
            for entry in files[:len(files) - MAX_FILES]:
                remove(entry.path)

    def _path(self, response_id: str) -> str:
        return os.path.join(self.directory, f"{response_id}.json")

