"""Runs the engine's step loop in a thread and streams outputs to asyncio callers."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kvtier.config import Config
from kvtier.devices import on_device
from kvtier.engine.engine import LLMEngine
from kvtier.engine.outputs import RequestFailed, RequestOutput
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.warmup import warm_up

log = logging.getLogger("kvtier.engine")


class AsyncEngine:
    def __init__(self, config: Config, warm: bool = True):
        """warm: pay the process's one-time costs now (warmup.py), before the first request; a server does."""
        self.engine = LLMEngine(config)
        if warm:
            warm_up(self.engine)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.max_pinned_tokens = self.engine.max_pinned_tokens
        # ("add", id, prompt, params, pins, cache_salt) | ("abort", id) | None to stop
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=on_device(self.engine.device, self._run), name="kvtier-engine",
                                        daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       pins: list[tuple[int, int]] | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        self.engine.check_request(len(prompt_token_ids), params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", request_id, prompt_token_ids, params, pins, cache_salt))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, Exception):
                    raise out
                if out.error is not None:
                    raise RequestFailed(out.error)
                finished = out.finished
                yield out
        finally:
            if not finished:   # the caller went away: free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)
        self.engine.shutdown()   # let queued saves reach the tiers: the next start finds them on disk

    def _run(self) -> None:
        while True:
            # idle: sleep until a message arrives; busy: take whatever is queued and step
            block = not self.engine.has_unfinished()
            try:
                msg = self._inbox.get(block=block)
                while True:
                    if msg is None:
                        return
                    self._handle(msg)
                    msg = self._inbox.get_nowait()
            except queue.Empty:
                pass
            try:
                outputs = self.engine.step()
            except Exception as e:   # a bug outside any one request: fail every open request loudly
                log.exception("engine step failed")
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                    self._deliver(request_id, RequestFailed(f"the engine failed ({type(e).__name__}: {e})"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _handle(self, msg) -> None:
        if msg[0] == "add":
            _, request_id, *request = msg
            try:
                self.engine.add_request(request_id, *request)
            except Exception as e:
                self._deliver(request_id, e)
        else:
            self.engine.abort_request(msg[1])

    def _deliver(self, request_id: str, item) -> None:
        done = isinstance(item, Exception) or item.finished
        entry = self._streams.pop(request_id, None) if done else self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)
