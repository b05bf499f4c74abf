"""How engine outputs become OpenAI responses and stream chunks."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from pydantic import BaseModel

from kvtier.engine.outputs import RequestOutput, TokenLogprob
from kvtier.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    FunctionCallDelta,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from kvtier.server.reasoning import ReplyReader


class Renderer:
    """Builds one request's responses in one API's shape; streaming renderers keep their position."""
    id_prefix = ""
    # whether a stream may answer before its first output, with SSE comments until it comes (app.py): clients whose
    # watchdogs count only events would start counting at the answer
    answers_early = True

    def __init__(self, model: str, token_str: Callable[[int], str]):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.token_str = token_str

    def response(self, out: RequestOutput) -> BaseModel:
        """The whole answer, from an output that carries the whole completion."""
        raise NotImplementedError

    def events(self, out: RequestOutput) -> list[str]:
        """The server-sent events for one delta."""
        raise NotImplementedError

    def closing_events(self, last: RequestOutput) -> list[str]:
        raise NotImplementedError

    def error_events(self, message: str) -> list[str]:
        """How a stream ends when its request failed midway."""
        raise NotImplementedError


class _OpenAIRenderer(Renderer):
    """OpenAI's streams: `data: {chunk}` events, usage on request, and `data: [DONE]` however they end."""

    def __init__(self, model: str, token_str: Callable[[int], str], include_usage: bool = False, index: int = 0):
        super().__init__(model, token_str)
        self.include_usage = include_usage
        self.index = index          # which choice (n) this renderer writes

    def chunks(self, out: RequestOutput) -> list[BaseModel]:
        raise NotImplementedError

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        raise NotImplementedError

    def events(self, out: RequestOutput) -> list[str]:
        return [_data(chunk) for chunk in self.chunks(out)]

    def closing_events(self, last: RequestOutput) -> list[str]:
        return ([_data(self.usage_chunk(last))] if self.include_usage else []) + [DONE]

    def error_events(self, message: str) -> list[str]:
        return [f"data: {json.dumps(APIError(500, message, type='server_error').body())}\n\n", DONE]

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


DONE = "data: [DONE]\n\n"


def _data(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


class ChatRenderer(_OpenAIRenderer):
    """Reasoning becomes reasoning_content; with a tool parser, calls in the output become tool_calls (or, for
    the legacy functions API, a function_call) and never reach the content."""
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, token_str: Callable[[int], str], include_usage: bool = False,
                 reader: ReplyReader | None = None, legacy_functions: bool = False, max_calls: int | None = None,
                 index: int = 0):
        super().__init__(model, token_str, include_usage, index)
        self.sent_role = False
        self.reader = reader or ReplyReader(False, None, None)
        self.legacy = legacy_functions
        self.max_calls = 1 if legacy_functions else max_calls    # parallel_tool_calls=false: the first call only
        self.num_calls = 0

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        reply = self.reader.read(out.new_text)
        content, calls = reply.content, reply.calls[:self.max_calls]
        message = ChatResponseMessage(content=content or None if calls else content,
                                      reasoning_content=reply.reasoning or None)
        if calls and self.legacy:
            message.function_call = FunctionCall(name=calls[0].name, arguments=calls[0].arguments)
        elif calls:
            message.tool_calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                                  for c in calls]
        choice = ChatChoice(index=self.index, message=message, logprobs=self._logprobs(out.logprobs),
                            finish_reason=self._finish_reason(out, bool(calls)))
        return ChatCompletionResponse(**self._head(), choices=[choice], usage=Usage.of(out))

    def chunks(self, out: RequestOutput) -> list[ChatCompletionChunk]:
        """The chunks for one delta: content first, then each completed call as its id and name, then its
        arguments; the finish reason on the last. None of them when there is nothing to say."""
        reply = self.reader.feed(out.new_text, final=out.finished)
        content, calls = reply.content, reply.calls
        if self.max_calls is not None:
            calls = calls[:max(0, self.max_calls - self.num_calls)]
        deltas = [ChatDelta(reasoning_content=reply.reasoning)] if reply.reasoning else []
        deltas += [ChatDelta(content=content)] if content or (out.logprobs and not reply.reasoning) else []
        for call in calls:
            if self.legacy:
                deltas += [ChatDelta(function_call=FunctionCallDelta(name=call.name, arguments="")),
                           ChatDelta(function_call=FunctionCallDelta(arguments=call.arguments))]
            else:
                index = self.num_calls
                deltas += [ChatDelta(tool_calls=[ToolCallDelta(index=index, id=call.id, type="function",
                                                               function=FunctionCallDelta(name=call.name,
                                                                                          arguments=""))]),
                           ChatDelta(tool_calls=[ToolCallDelta(index=index,
                                                               function=FunctionCallDelta(arguments=call.arguments))])]
            self.num_calls += 1
        if not self.sent_role:       # a role-only first chunk
            deltas.insert(0, ChatDelta(role="assistant"))
            self.sent_role = True
        if out.finished:             # and the finish reason on an empty last one
            deltas.append(ChatDelta())
        return [ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(
            index=self.index, delta=delta, logprobs=self._logprobs(out.logprobs) if delta.content is not None else None,
            finish_reason=self._finish_reason(out, self.num_calls > 0) if out.finished and i == len(deltas) - 1
            else None)]) for i, delta in enumerate(deltas)]

    def _finish_reason(self, out: RequestOutput, called: bool) -> str | None:
        if not out.finished or not called or out.finish_reason != "stop":
            return out.finish_reason
        return "function_call" if self.legacy else "tool_calls"

    def usage_chunk(self, out: RequestOutput) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[], usage=Usage.of(out))

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            token = self.token_str(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, l) for t, l in lp.top])
            for lp in logprobs])


class CompletionRenderer(_OpenAIRenderer):
    id_prefix = "cmpl-"

    def __init__(self, model: str, token_str: Callable[[int], str], include_usage: bool = False, echo: str = "",
                 index: int = 0):
        super().__init__(model, token_str, include_usage, index)
        self.text_offset = 0   # characters of completion text before the next token
        self.echo = echo       # the prompt, sent before the completion (echo=true)

    def response(self, out: RequestOutput) -> CompletionResponse:
        return CompletionResponse(**self._head(), choices=[self._choice(out)], usage=Usage.of(out))

    def chunks(self, out: RequestOutput) -> list[CompletionResponse]:
        if not out.new_text and not out.logprobs and not out.finished and not self.echo:
            return []
        return [CompletionResponse(**self._head(), choices=[self._choice(out)])]

    def usage_chunk(self, out: RequestOutput) -> CompletionResponse:
        return CompletionResponse(**self._head(), choices=[], usage=Usage.of(out))

    def _choice(self, out: RequestOutput) -> CompletionChoice:
        text, self.echo = self.echo + out.new_text, ""
        return CompletionChoice(index=self.index, text=text, logprobs=self._logprobs(out.logprobs),
                                finish_reason=out.finish_reason)

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in logprobs:
            token = self.token_str(lp.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(lp.logprob)
            result.top_logprobs.append({self.token_str(t): l for t, l in lp.top})
            result.text_offset.append(self.text_offset)
            self.text_offset += len(token)
        return result
