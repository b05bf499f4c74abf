"""How a request's outputs reach the client: its choices interleaved, folded into one answer, or written
as server-sent events in its API's protocol; and awaiting them without missing a client that went away."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvtier.engine.outputs import RequestFailed, RequestOutput, RequestRejected
from kvtier.server.protocol import APIError, Usage
from kvtier.server.render import Renderer

DISCONNECT_POLL_S = 0.2
KEEPALIVE = ": keep-alive\n\n"     # an SSE comment: every client's parser skips it, its read timeouts see bytes


def choice_renderers(n: int | None, make: Callable[[int], Renderer]) -> list[Renderer]:
    """One renderer per choice, all answering under the first one's id."""
    renderers = [make(index) for index in range(n or 1)]
    for renderer in renderers[1:]:
        renderer.id, renderer.created = renderers[0].id, renderers[0].created
    return renderers


async def merged(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Fold a request's deltas into one output that carries the whole completion."""
    outs = [out async for out in outputs]
    last = outs[-1]
    return dataclasses.replace(
        last,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        logprobs=None if last.logprobs is None else [lp for o in outs for lp in o.logprobs],
    )


def combined(renderers: list[Renderer], whole: list[RequestOutput]) -> BaseModel:
    """One response holding every choice; usage counts the prompt once and every choice's tokens."""
    response = renderers[0].response(whole[0])
    if len(renderers) > 1:
        response.choices = [choice for r, out in zip(renderers, whole) for choice in r.response(out).choices]
        response.usage = Usage.of(total(whole))
    return response


def total(lasts: list[RequestOutput]) -> RequestOutput:
    """The first choice's last output, counting every choice's generated tokens."""
    return dataclasses.replace(lasts[0], num_output_tokens=sum(out.num_output_tokens for out in lasts))


async def interleaved(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice, output) pairs from every stream as they come; leaving early closes them all (aborting them)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    await queue.put((index, out))
        except Exception as e:     # re-raised to the reader
            await queue.put((index, e))
        await queue.put((index, None))
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def sse(outputs: AsyncIterator[tuple[int, RequestOutput]], renderers: list[Renderer],
              keepalive: float) -> AsyncIterator[str]:
    """The stream's events, in the renderers' protocol; a request that fails midway ends with its error event. While
    no output comes for `keepalive` seconds (a long prompt's prefill, a full engine), a comment each time."""
    lasts: dict[int, RequestOutput] = {}
    try:
        async with aclosing(outputs), aclosing(beating(outputs, keepalive)) as items:
            async for item in items:
                if item is None:
                    yield KEEPALIVE
                    continue
                index, out = item
                lasts[index] = out
                for event in renderers[index].events(out):
                    yield event
            for event in renderers[0].closing_events(total([lasts[i] for i in sorted(lasts)])):
                yield event
    except (RequestFailed, RequestRejected) as e:     # rejected: only where the stream answered before the engine
        for event in renderers[0].error_events(str(e)):
            yield event


async def beating(items: AsyncIterator, seconds: float) -> AsyncIterator:
    """`items` as they come, and None each time `seconds` pass without one."""
    pending = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait([pending], timeout=seconds)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:     # left early: stop the wait, and let it end before `items` is closed
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """Closes its generator however the stream ends: a client that goes away aborts its request."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def unless_disconnected(request: Request, awaitable: Awaitable):
    """Await `awaitable`; if the client disconnects first, cancel it (aborting the engine request)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not (await asyncio.wait([task], timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                raise APIError(499, "the client closed the connection")
        return task.result()
    finally:
        task.cancel()
