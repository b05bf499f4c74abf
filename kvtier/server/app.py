"""The HTTP server: OpenAI chat / completions / Responses and Anthropic Messages routes, and the generation
path they share (errors.py, guards.py and streaming.py hold the rest)."""
from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvtier.engine.outputs import RequestFailed, RequestOutput, RequestRejected
from kvtier.server.anthropic import CountTokensRequest, MessagesRenderer, MessagesRequest
from kvtier.server.errors import install_error_handlers
from kvtier.server.guards import APIKeyGuard, BodyLimit
from kvtier.server.metrics import Metrics, RequestCounter
from kvtier.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    KvtierOptions,
    ModelCard,
    ModelList,
    find_unencodable,
    text_chars,
)
from kvtier.server.reasoning import ReplyReader, reasoning_parser_for_template, starts_inside
from kvtier.server.render import ChatRenderer, CompletionRenderer, Renderer
from kvtier.server.responses import ResponsesRenderer, ResponsesRequest, ResponseStore
from kvtier.server.scripted import ScriptedReplies
from kvtier.server.streaming import SSEResponse, choice_renderers, combined, interleaved, merged, sse, \
    unless_disconnected
from kvtier.server.tool_parsers import PARSERS, ToolParser, parser_for_template
from kvtier.server.tools import grammar_error, json_grammar, template_messages, tool_call_grammar

if TYPE_CHECKING:   # the engine pulls in the model code; the app only needs its interface
    from kvtier.config import Config
    from kvtier.engine.async_engine import AsyncEngine

ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                       "/v1/responses", "/v1/models"})


def build_app(engine: AsyncEngine, config: Config) -> FastAPI:
    app = FastAPI(title="kvtier", summary="OpenAI-compatible LLM server with a tiered KV cache")
    metrics = Metrics(engine)
    parser = PARSERS[config.tool_call_parser] if config.tool_call_parser else \
        parser_for_template(engine.tokenizer.chat_template)
    store = ResponseStore(os.path.join(os.path.expanduser(config.kv_disk_dir), "responses") if config.kv_disk else None)
    routes = _Routes(engine, config.served_model_names or [engine.model_name], config.any_model_name, metrics,
                     config.cache_salt_from_api_key, parser, _reasoning_parser(engine, config), store,
                     config.sse_keepalive)
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/messages", routes.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"])
    app.add_api_route("/v1/responses", routes.responses, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/", routes.health, methods=["GET", "HEAD"])     # agents check that the server answers
    app.add_api_route("/metrics", routes.scrape, methods=["GET"])
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(APIKeyGuard, api_keys=config.api_keys)
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)   # outermost: counts 401s too
    return app


def _reasoning_parser(engine: AsyncEngine, config: Config) -> str | None:
    """--reasoning-parser, or the one the chat template's thinking format calls for (None: no reasoning)."""
    if config.reasoning_parser is not None:
        return None if config.reasoning_parser == "none" else config.reasoning_parser
    try:
        generation_prompt = engine.tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    except ValueError:       # no chat template, or one that needs more than a user message
        generation_prompt = ""
    return reasoning_parser_for_template(engine.tokenizer.chat_template, generation_prompt)


async def _first_output(gen: AsyncIterator[RequestOutput]) -> tuple[RequestOutput, float]:
    """A request's first output, and when it came."""
    out = await anext(gen)
    return out, time.perf_counter()


class _Routes:
    def __init__(self, engine: AsyncEngine, model_names: list[str], any_model_name: bool, metrics: Metrics,
                 salt_from_api_key: bool, tool_parser: ToolParser, reasoning_parser: str | None,
                 response_store: ResponseStore, keepalive: float):
        self.engine = engine
        self.keepalive = keepalive      # --sse-keepalive
        self.reasoning_parser = reasoning_parser
        self.script = ScriptedReplies.from_environment()
        self.response_store = response_store
        self.tool_parser = tool_parser
        self.salt_from_api_key = salt_from_api_key
        self.model_names = model_names      # answers name the model as the request did
        self.any_model_name = any_model_name
        self.metrics = metrics
        self.created = int(time.time())

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        # templating and tokenizing a large body takes seconds: never on the event loop
        prompt, reader, grammar = await run_in_threadpool(self._chat_prompt, body)
        renderers = choice_renderers(body.n, lambda index: ChatRenderer(
            body.model, self.engine.tokenizer.token_str, body.include_usage, reader(), body.legacy_functions,
            max_calls=1 if body.parallel_tool_calls is False else None, index=index))
        return await self._generate(request, body, prompt, renderers, grammar)

    async def messages(self, body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API, served through the chat machinery."""
        self._check_model(body.model)
        chat, marked = body.to_chat()
        prompt, reader, grammar = await run_in_threadpool(self._chat_prompt, chat)
        if marked and self.engine.max_pinned_tokens and not chat.kvtier:
            # a cache_control breakpoint keeps its prefix resident (as much of it as the budget allows)
            marked_prefix = chat.model_copy(update={"messages": chat.messages[:marked]})
            end = len((await run_in_threadpool(self._chat_prompt, marked_prefix))[0])
            chat.kvtier = KvtierOptions(pin=[(0, min(end, len(prompt), self.engine.max_pinned_tokens))])
        renderer = MessagesRenderer(body.model, self.engine.tokenizer.token_str, reader())
        return await self._generate(request, chat, prompt, [renderer], grammar)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, served through the chat machinery; previous_response_id continues a kept
        conversation (and restores its KV from the tiers)."""
        self._check_model(body.model)
        history = []
        if body.previous_response_id is not None:
            history = self.response_store.get(body.previous_response_id)
            if history is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
        conversation = history + body.messages()
        chat = body.to_chat(history)
        prompt, reader, grammar = await run_in_threadpool(self._chat_prompt, chat)

        def keep(response_id: str, output: list[dict]) -> None:
            if body.store is not False:
                self.response_store.put(response_id, conversation + output)
        renderer = ResponsesRenderer(body.model, self.engine.tokenizer.token_str, body, reader(), keep)
        return await self._generate(request, chat, prompt, [renderer], grammar)

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        self._check_model(body.model)
        prompt, _, _ = await run_in_threadpool(self._chat_prompt, body.to_chat()[0])
        return {"input_tokens": len(prompt)}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        prompt = await run_in_threadpool(self._completion_prompt, body)
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else \
            self.engine.tokenizer.decode(body.prompt)
        renderers = choice_renderers(body.n, lambda index: CompletionRenderer(
            body.model, self.engine.tokenizer.token_str, body.include_usage, echo, index=index))
        return await self._generate(request, body, prompt, renderers)

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], Callable[[], ReplyReader], str | None]:
        """The prompt, what makes a reader of the reply (its reasoning and, with tools, its calls), and the
        grammar the reply must follow (a forced call, a JSON schema; None if free)."""
        tokenizer = self.engine.tokenizer
        mode = body.tool_mode()
        functions = body.functions_offered()
        # tools stay in the prompt with tool_choice "none" (as in vLLM), so a tool loop's prefix never changes
        tools = [{"type": "function", "function": f} for f in functions] or None
        conversation = [m.for_template() for m in body.messages]
        self._check_text(body, text_chars(conversation) + text_chars(tools), "messages")
        messages, template_tools = template_messages(conversation, tools, tokenizer.knows_tools)
        try:
            prompt = tokenizer.apply_chat_template(messages, template_tools, **body.template_kwargs())
        except ValueError as e:
            raise APIError(400, f"cannot build a chat prompt: {e}", param="messages") from None
        parser = self.tool_parser if mode not in (None, "none") else None
        grammar = self._grammar(body, mode, functions, self.tool_parser, tokenizer.added_tokens)
        # a reply a grammar writes is all content; else the prompt's end says where the reply starts
        reasoning = self.reasoning_parser is not None and grammar is None
        if self.script is not None and grammar is None:
            grammar = self.script.grammar(conversation, [f["name"] for f in functions], tokenizer.added_tokens)
        inside = starts_inside(self.reasoning_parser, tokenizer.decode(prompt[-4:], skip_special_tokens=False)) \
            if reasoning else None
        return prompt, functools.partial(ReplyReader, reasoning, inside, parser), grammar

    @staticmethod
    def _grammar(body: ChatCompletionRequest, mode: str | None, functions: list[dict], parser: ToolParser,
                 tokens: frozenset[str]) -> str | None:
        schema = body.output_schema()
        forced = mode not in (None, "none", "auto")
        if forced and schema is not None:
            raise APIError(400, "response_format cannot be combined with a forced tool call", param="response_format")
        if forced:
            param = "function_call" if body.legacy_functions else "tool_choice"
            called = [f for f in functions if mode == "required" or f["name"] == mode]
            grammar = tool_call_grammar(called, parser.name, parallel=mode == "required" and
                                        body.parallel_tool_calls is not False and not body.legacy_functions,
                                        tokens=tokens)
        elif schema is not None:
            param, grammar = "response_format", json_grammar(schema)
        else:
            return None
        error = grammar_error(grammar)
        if error is not None:
            raise APIError(400, f"the schema cannot be enforced: {error}", param=param)
        return grammar

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            self._check_text(body, len(body.prompt), "prompt")
            return self.engine.tokenizer.encode(body.prompt)
        vocab_size = self.engine.tokenizer.vocab_size
        if not all(0 <= t < vocab_size for t in body.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        return body.prompt

    def _check_text(self, body: BaseModel, chars: int, param: str) -> None:
        """Refuse text the tokenizer cannot take, and prompts that are too long for certain, before tokenizing."""
        where = find_unencodable(body.model_dump(exclude_none=True))
        if where is not None:
            raise APIError(400, f"{where} is not valid Unicode text (it holds a lone surrogate)",
                           param=where.split(".")[0].split("[")[0])
        least = chars // self.engine.tokenizer.max_token_chars
        if least > self.engine.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens, but "
                                f"the {param} hold {chars} characters, at least {least} tokens", param=param)

    def _cache_salt(self, request: Request, body: ChatCompletionRequest | CompletionRequest) -> str | None:
        """The request's cache salt; with salts from API keys, its key's salt comes first."""
        if not self.salt_from_api_key:
            return body.cache_salt
        return f"{request.state.api_key}\0{body.cache_salt or ''}"

    async def models(self) -> ModelList:
        return ModelList(data=[self._card(name) for name in self.model_names])

    async def model(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return self._card(model_id)

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.engine.max_model_len)

    async def health(self) -> dict:
        return {"status": "ok"}

    async def scrape(self) -> Response:
        content, media_type = self.metrics.exposition()
        return Response(content, media_type=media_type)

    def _check_model(self, model: str) -> None:
        if model not in self.model_names and not self.any_model_name:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise APIError(404, f"the model '{model}' does not exist; this server serves {served} "
                                "(--any-model-name answers to any name)", param="model", code="model_not_found")

    async def _generate(self, request: Request, body: ChatCompletionRequest | CompletionRequest, prompt: list[int],
                        renderers: list[Renderer], grammar: str | None = None) -> Response:
        """Shared by every route, streaming or not; one renderer per choice (n). It answers once the first output
        comes, so that a rejected request gets a 400, not a broken stream; but a stream of one choice whose prompt
        takes longer than --sse-keepalive answers then, where its protocol allows (`Renderer.answers_early`), and
        sends comments until its first token (clients give up on a response that sends nothing: Node's fetch after
        300 s)."""
        params = body.sampling_params(len(prompt), self.engine.max_model_len, grammar)
        pins, salt = body.kvtier.pin if body.kvtier else None, self._cache_salt(request, body)
        request_id = renderers[0].id
        arrival = time.perf_counter()
        gen = self.engine.generate(request_id, prompt, params, pins, salt)
        first = asyncio.ensure_future(_first_output(gen))
        answer_early = body.stream and len(renderers) == 1 and renderers[0].answers_early
        try:
            await unless_disconnected(request, asyncio.wait([first], timeout=self.keepalive if answer_early else None))
        except BaseException:
            first.cancel()      # the client went away: the request is aborted
            raise
        others = []       # the other choices: only where the first output came (answered early: one choice)
        if first.done():
            try:
                _, first_token = first.result()
            except RequestRejected as e:
                raise APIError(400, str(e)) from None
            except RequestFailed as e:
                raise APIError(500, str(e), type="server_error") from None
            # the first choice has computed the prompt and cached its full blocks: the other choices reuse them
            others = [self._observed(self.engine.generate(f"{request_id}-{i}", prompt, params.for_choice(i), pins,
                                                          salt), arrival, first_token=first_token)
                      for i in range(1, len(renderers))]
        streams = [self._observed(gen, arrival, first)] + others
        if body.stream:
            return SSEResponse(sse(interleaved(streams), renderers, self.keepalive), media_type="text/event-stream")
        try:
            whole = await unless_disconnected(request, asyncio.gather(*(merged(s) for s in streams)))
        except RequestFailed as e:
            raise APIError(500, str(e), type="server_error") from None
        return Response(combined(renderers, whole).model_dump_json(), media_type="application/json")

    async def _observed(self, gen: AsyncIterator[RequestOutput], arrival: float,
                        first: asyncio.Future | None = None, first_token: float | None = None
                        ) -> AsyncIterator[RequestOutput]:
        """The first output (`first`: the task awaiting it, when given; its time to first token recorded), then the
        rest of `gen`; the request's metrics are recorded when it finishes."""
        async with aclosing(gen):
            out = None
            if first is not None:
                out, first_token = await first
                self.metrics.time_to_first_token.observe(first_token - arrival)
                yield out
            async for out in gen:
                yield out
        if out is not None and out.finished:
            self.metrics.observe_finished(out, arrival, first_token, time.perf_counter())
