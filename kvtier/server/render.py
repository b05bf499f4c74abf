"""How engine outputs become OpenAI responses and stream chunks."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from kvtier.engine.outputs import RequestOutput, TokenLogprob
from kvtier.server.protocol import (
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
    Usage,
)


class _Renderer:
    """Builds one request's responses; streaming renderers keep their position between chunks."""
    id_prefix = ""

    def __init__(self, model: str, token_str: Callable[[int], str]):
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.token_str = token_str

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}


class ChatRenderer(_Renderer):
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, token_str: Callable[[int], str]):
        super().__init__(model, token_str)
        self.sent_role = False

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choice = ChatChoice(message=ChatResponseMessage(content=out.new_text),
                            logprobs=self._logprobs(out.logprobs), finish_reason=out.finish_reason)
        return ChatCompletionResponse(**self._head(), choices=[choice], usage=Usage.of(out))

    def chunk(self, out: RequestOutput) -> ChatCompletionChunk | None:
        """The chunk for one delta; None when it carries nothing (text held back, no logprobs)."""
        if self.sent_role and not out.new_text and not out.logprobs and not out.finished:
            return None
        delta = ChatDelta(role=None if self.sent_role else "assistant", content=out.new_text or None)
        self.sent_role = True
        choice = ChatChunkChoice(delta=delta, logprobs=self._logprobs(out.logprobs), finish_reason=out.finish_reason)
        return ChatCompletionChunk(**self._head(), choices=[choice])

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


class CompletionRenderer(_Renderer):
    id_prefix = "cmpl-"

    def __init__(self, model: str, token_str: Callable[[int], str], echo: str = ""):
        super().__init__(model, token_str)
        self.text_offset = 0   # characters of completion text before the next token
        self.echo = echo       # the prompt, sent before the completion (echo=true)

    def response(self, out: RequestOutput) -> CompletionResponse:
        return CompletionResponse(**self._head(), choices=[self._choice(out)], usage=Usage.of(out))

    def chunk(self, out: RequestOutput) -> CompletionResponse | None:
        if not out.new_text and not out.logprobs and not out.finished and not self.echo:
            return None
        return CompletionResponse(**self._head(), choices=[self._choice(out)])

    def usage_chunk(self, out: RequestOutput) -> CompletionResponse:
        return CompletionResponse(**self._head(), choices=[], usage=Usage.of(out))

    def _choice(self, out: RequestOutput) -> CompletionChoice:
        text, self.echo = self.echo + out.new_text, ""
        return CompletionChoice(text=text, logprobs=self._logprobs(out.logprobs), finish_reason=out.finish_reason)

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
