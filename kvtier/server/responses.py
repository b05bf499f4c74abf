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
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from kvtier.engine.outputs import RequestOutput
from kvtier.kv.tiers.files import atomic_write, read_regular, regular_files, remove
from kvtier.server.protocol import APIError, ChatCompletionRequest, KvtierOptions, RequestModel
from kvtier.server.reasoning import ReplyReader
from kvtier.server.render import Renderer
from kvtier.server.tool_parsers import ToolCall

log = logging.getLogger("kvtier.server")

MAX_IN_MEMORY = 1024
MAX_FILES = 4096


# ---------------------------------------------------------------- requests

class InputItem(BaseModel, extra="allow"):
    """A message, a function call or a function call's output; clients send back output items with every
    key they were given (ids, statuses), so extra keys pass."""
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict] | None = None


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel, populate_by_name=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    text: TextOptions | None = None
    metadata: dict | None = None           # the caller's labels: echoed back, not used
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    kvtier: KvtierOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def messages(self) -> list[dict]:
        """The input items as chat messages (without the instructions, which never carry over)."""
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages: list[dict] = []
        for item in items:
            if item.type == "message":
                messages.append({"role": "system" if item.role == "developer" else item.role or "user",
                                 "content": _text(item.content)})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                if messages and messages[-1]["role"] == "assistant":     # parallel calls share one message
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        return messages

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in self.tools or []] or None
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text else None
        response_format = None if fmt is None else {"type": fmt.type, **(
            {"json_schema": {"name": fmt.name or "output", "schema": fmt.json_schema}} if fmt.type == "json_schema"
            else {})}
        try:
            return ChatCompletionRequest(
                model=self.model, messages=system + history + self.messages(), tools=tools, tool_choice=choice,
                parallel_tool_calls=self.parallel_tool_calls, max_tokens=self.max_output_tokens,
                temperature=self.temperature, top_p=self.top_p, stream=self.stream, response_format=response_format,
                kvtier=self.kvtier, cache_salt=self.cache_salt)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise APIError(400, f"the input cannot be served: {problems}", param="input") from None


def _text(content) -> str:
    """Text of a message's content or a call's output: a string, or parts with text."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))


# ---------------------------------------------------------------- responses

class ResponsesRenderer(Renderer):
    """Response objects and the Responses stream: response.created, then per output item (reasoning, a
    message, or a function call once complete) its added / delta / done events, then response.completed.
    on_done gets the output as chat messages, for the store."""
    id_prefix = "resp_"

    def __init__(self, model: str, token_str: Callable[[int], str], body: ResponsesRequest, reader: ReplyReader,
                 on_done: Callable[[str, list[dict]], None] | None):
        super().__init__(model, token_str)
        self.body, self.reader, self.on_done = body, reader, on_done
        self.sequence = 0
        self.items: list[dict] = []         # output items so far (the open item's text grows)
        self.open_item: dict | None = None  # the reasoning or message item streaming now

    def response(self, out: RequestOutput) -> BaseModel:
        reply = self.reader.read(out.new_text)
        self.items = ([_reasoning_item(reply.reasoning)] if reply.reasoning else []) + \
            ([_message_item(reply.content)] if reply.content else []) + [_call_item(call) for call in reply.calls]
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
        for call in reply.calls:
            events += self._close()
            item = _call_item(call)
            self.items.append(item)
            index = len(self.items) - 1
            events += [self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
                       self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=call.arguments),
                       self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=call.arguments),
                       self._event("response.output_item.done", output_index=index, item=item)]
        return events

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
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
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


def _call_item(call: ToolCall) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _as_messages(items: list[dict]) -> list[dict]:
    """Output items as the chat messages a continuation renders."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    reasoning = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"reasoning_content": reasoning} if reasoning else {}),
             **({"tool_calls": calls} if calls else {})}]


# ---------------------------------------------------------------- the store

class ResponseStore:
    """Recent responses' conversations (chat messages, instructions left out), by response id: the newest
    MAX_IN_MEMORY in memory, and with a directory the newest MAX_FILES as JSON files (mode 0600) that
    outlive a restart. Thread-safe."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._memory: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                log.warning("responses are kept in memory only: %s", e)
                self.directory = None

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._memory[response_id] = messages
            self._memory.move_to_end(response_id)
            while len(self._memory) > MAX_IN_MEMORY:
                self._memory.popitem(last=False)
        if self.directory is None:
            return
        try:
            atomic_write(self._path(response_id), [json.dumps(messages).encode()])
        except OSError as e:
            log.warning("could not keep response %s on disk: %s", response_id, e)
        self._trim()

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

