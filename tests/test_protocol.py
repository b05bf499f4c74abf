"""Request validation, response building and the HTTP plumbing, against a scripted engine (no model)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import sse_events
from fastapi.testclient import TestClient

from kvtier.config import Config, ConfigError
from kvtier.engine.outputs import RequestOutput, RequestRejected, TokenLogprob
from kvtier.server.app import build_app
from kvtier.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvtier.server.render import ChatRenderer, CompletionRenderer

MODEL = "stub-model"


class StubTokenizer:
    """One token per character; token id = code point."""
    vocab_size = 1000
    max_token_chars = 1
    eos_token_ids = frozenset()

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def token_str(self, token_id):
        return chr(token_id)

    chat_template = None
    knows_tools = False
    added_tokens = frozenset()

    def render_chat(self, messages, tools=None, **template_kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def apply_chat_template(self, messages, tools=None, **template_kwargs):
        return self.encode(self.render_chat(messages, tools, **template_kwargs))


class StubEngine:
    """Answers every request with `answer`, one character per output; can be told to hang."""

    def __init__(self, answer="hello"):
        self.tokenizer = StubTokenizer()
        self.model_name = MODEL
        self.max_model_len = 64
        self.max_pinned_tokens = None     # bounded residency off
        self.pins: list = []
        self.answer = answer
        self.hang = False
        self.running: set[str] = set()
        self.requests: list[tuple[list[int], object]] = []

    async def generate(self, request_id, prompt_token_ids, params, pins=None, cache_salt=None):
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRejected("too long for the stub")
        self.requests.append((prompt_token_ids, params))
        self.pins.append(pins)
        self.running.add(request_id)
        try:
            text = self.answer[:params.max_tokens]
            for i, c in enumerate(text):
                if self.hang:
                    await asyncio.Event().wait()
                last = i == len(text) - 1
                top = [(ord(c), -0.5), (ord("z"), -2.0)]
                lps = None if params.logprobs is None else [TokenLogprob(ord(c), -0.5, top)]
                yield RequestOutput(request_id, [ord(c)], c, lps, last,
                                    ("length" if len(text) == params.max_tokens else "stop") if last else None,
                                    len(prompt_token_ids), 0, i + 1)
        finally:
            self.running.discard(request_id)

    def stats(self):
        return {"num_blocks": 10, "num_free_blocks": 10 - len(self.running), "num_cached_blocks": 0, "block_size": 64,
                "num_running": len(self.running), "num_waiting": 0}


@pytest.fixture
def engine():
    return StubEngine()


@pytest.fixture
def client(engine):
    return TestClient(build_app(engine, Config()))


def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


# ---------------------------------------------------------------- request models

def test_chat_defaults_max_tokens_to_remaining_context():
    req = ChatCompletionRequest(**chat_body())
    assert req.sampling_params(num_prompt_tokens=40, max_model_len=64).max_tokens == 24
    assert req.sampling_params(40, 64).temperature == 1.0
    # more than the context has room for is capped to it (llama.cpp's behaviour; agents ask for 32K-64K)
    assert ChatCompletionRequest(**chat_body(max_tokens=64000)).sampling_params(40, 64).max_tokens == 24


def test_completion_default_max_tokens_is_16_capped_by_context():
    req = CompletionRequest(model=MODEL, prompt="x")
    assert req.sampling_params(10, 64).max_tokens == 16
    assert req.sampling_params(60, 64).max_tokens == 4


def test_max_completion_tokens_wins_over_max_tokens():
    req = ChatCompletionRequest(**chat_body(max_tokens=5, max_completion_tokens=7))
    assert req.sampling_params(1, 64).max_tokens == 7


def test_sampling_fields_reach_params():
    req = ChatCompletionRequest(**chat_body(temperature=0, top_p=0.5, top_k=-1, seed=3, stop="\n",
                                            logprobs=True, top_logprobs=2))
    p = req.sampling_params(1, 64)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.logprobs) == (0, 0.5, 0, 3, ["\n"], 2)
    assert ChatCompletionRequest(**chat_body(top_logprobs=2)).sampling_params(1, 64).logprobs is None


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("repetition_penalty", 0.0), ("logit_bias", {"5": 101}),
                                          ("logit_bias", {"five": 1}), ("min_tokens", 100),
                                          ("temperature", 5.0), ("top_p", 0.0), ("max_tokens", 0)])
def test_out_of_range_or_unsupported_is_400(field, value):
    req = ChatCompletionRequest(**chat_body(**{field: value}))
    with pytest.raises(APIError) as e:
        req.sampling_params(1, 64)
    assert e.value.status_code == 400


@pytest.mark.parametrize("fields", [{"echo": True, "logprobs": 1}, {"best_of": 3}, {"suffix": "x"}])
def test_unsupported_completion_fields(fields):
    with pytest.raises(APIError, match=next(iter(fields))):
        CompletionRequest(model=MODEL, prompt="x", **fields).sampling_params(1, 64)


def test_every_optional_field_takes_null(client):
    nulls = dict.fromkeys(("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                           "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
                           "max_completion_tokens", "user", "cache_salt", "min_tokens", "repetition_penalty"))
    r = client.post("/v1/chat/completions", json=chat_body(**nulls))
    assert r.status_code == 200, r.text
    completion = {"model": MODEL, "prompt": "hi", **dict.fromkeys(("echo", "best_of", "suffix", "logprobs", "n"))}
    assert client.post("/v1/completions", json=completion).status_code == 200


@pytest.mark.parametrize("field", ["audio", "prediction", "not_a_field"])
def test_unknown_or_unhonoured_fields_are_a_400_naming_them(client, field):
    err = error_of(client.post("/v1/chat/completions", json=chat_body(**{field: {"type": "x"}})), 400)
    assert err["param"] == field and "does not support" in err["message"]


def test_developer_role_is_system(client, engine):
    client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "developer", "content": "Be brief."},
                                                                 {"role": "user", "content": "hi"}]))
    assert "".join(map(chr, engine.requests[-1][0])).startswith("<system>Be brief.")


def test_model_by_id(client):
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert error_of(client.get("/v1/models/other"), 404)["code"] == "model_not_found"


def test_echo_prepends_the_prompt(client):
    body = {"model": MODEL, "prompt": "Say: ", "max_tokens": 3, "echo": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "Say: hel"
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Say: hel"


def test_text_parts_are_joined():
    req = ChatCompletionRequest(**chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]))
    assert req.messages[0].for_template() == {"role": "user", "content": "a\nb"}


def test_a_batch_of_one_prompt_is_unwrapped():
    assert CompletionRequest(model=MODEL, prompt=["hi"]).prompt == "hi"
    assert CompletionRequest(model=MODEL, prompt=[[1, 2]]).prompt == [1, 2]
    with pytest.raises(ValueError, match="only one prompt"):
        CompletionRequest(model=MODEL, prompt=["a", "b"])


def test_image_parts_are_rejected():
    with pytest.raises(ValueError, match="only text content parts"):
        ChatCompletionRequest(**chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))


# ---------------------------------------------------------------- renderers

def out(text, finished=False, reason=None, logprobs=None, n=1):
    return RequestOutput("r", [ord(c) for c in text], text, logprobs, finished, reason, 3, 1, n)


def test_chat_chunks_send_role_once_and_skip_empty_deltas():
    r = ChatRenderer(MODEL, chr)
    role, first = (c.model_dump() for c in r.chunks(out("a")))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": None}     # a role-only first chunk
    assert first["choices"][0]["delta"] == {"role": None, "content": "a"}
    assert r.chunks(out("")) == []                  # text held back: nothing to send
    last, = (c.model_dump() for c in r.chunks(out("", finished=True, reason="stop")))
    assert last["choices"][0]["delta"] == {"role": None, "content": None}
    assert last["choices"][0]["finish_reason"] == "stop"
    assert r.usage_chunk(out("", True, "stop", n=4)).model_dump()["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 1}}


def test_chat_logprobs_shape():
    lp = [TokenLogprob(ord("a"), -0.1, [(ord("a"), -0.1), (ord("b"), -2.5)])]
    body = ChatRenderer(MODEL, chr).response(out("a", True, "stop", lp)).model_dump()
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "b", "logprob": -2.5, "bytes": [98]}]}]


def test_completion_logprobs_offsets_continue_across_chunks():
    r = CompletionRenderer(MODEL, lambda i: chr(i) * 2)   # two characters per token
    lp = lambda c: [TokenLogprob(ord(c), -1.0, [(ord(c), -1.0)])]
    first = r.chunks(out("a", logprobs=lp("a")))[0].model_dump()["choices"][0]["logprobs"]
    second = r.chunks(out("b", logprobs=lp("b")))[0].model_dump()["choices"][0]["logprobs"]
    assert first == {"tokens": ["aa"], "token_logprobs": [-1.0], "top_logprobs": [{"aa": -1.0}], "text_offset": [0]}
    assert second["text_offset"] == [2]


# ---------------------------------------------------------------- HTTP plumbing (stub engine)

def test_chat_non_streaming(client, engine):
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hel"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert engine.requests[0][0] == engine.tokenizer.encode("<user>hi<assistant>")


def test_chat_streaming_with_usage(client):
    r = client.post("/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["delta"]["content"] or "" for e in events[:-1]) == "hello"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_completions_token_prompt_streaming_and_logprobs(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "stream": True, "logprobs": 1})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "hello"
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events] == [[0], [1], [2], [3], [4]]
    assert engine.requests[0][0] == [1, 2, 3]


def test_completions_non_streaming_logprobs(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "logprobs": 1}).json()
    choice = body["choices"][0]
    assert choice["text"] == "hello"
    assert choice["logprobs"]["tokens"] == list("hello")
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    assert body["usage"]["prompt_tokens"] == 3


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_errors_have_openai_shape(client):
    json_header = {"content-type": "application/json"}
    err = error_of(client.post("/v1/chat/completions", content=b"{not json", headers=json_header), 400)
    assert "not valid JSON" in err["message"]
    err = error_of(client.post("/v1/chat/completions", content=b"model=x"), 400)
    assert "JSON object" in err["message"]
    err = error_of(client.post("/v1/chat/completions", json=[1]), 400)
    assert "JSON object" in err["message"]
    err = error_of(client.post("/v1/chat/completions", json={"model": MODEL}), 400)
    assert err["param"] == "messages" and "Field required" in err["message"]
    err = error_of(client.post("/v1/chat/completions", json=chat_body(max_tokens="many")), 400)
    assert err["param"] == "max_tokens"
    err = error_of(client.post("/v1/chat/completions", json=chat_body(model="gpt-4")), 404)
    assert err["code"] == "model_not_found"
    error_of(client.post("/v1/chat/completions", json=chat_body(temperature=5)), 400)
    error_of(client.post("/v1/chat/completions", json=chat_body(n=0)), 400)
    err = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 64, "max_tokens": 10}), 400)
    assert "too long" in err["message"]
    # a prompt that fits gets max_tokens capped to the context's room, and ends with "length"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 60, "max_tokens": 10})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 4
    error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": [5000]}), 400)
    error_of(client.get("/v1/nope"), 404)
    error_of(client.get("/v1/chat/completions"), 405)


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/docs", "/redoc", "/openapi.json"])
def test_api_key_guards_every_route_but_health(engine, path):
    client = TestClient(build_app(engine, Config(api_keys=["sesame", "open"])))
    assert error_of(client.get(path), 401)["code"] == "invalid_api_key"
    error_of(client.get(path, headers={"Authorization": "Bearer wrong"}), 401)
    error_of(client.get(path, headers={"Authorization": "Basic sesame"}), 401)
    for headers in ({"Authorization": "Bearer sesame"}, {"Authorization": "bearer open"},
                    {"authorization": "BEARER sesame"}, {"x-api-key": "open"}):
        assert client.get(path, headers=headers).status_code == 200, headers
    assert client.get("/health").status_code == 200


def test_api_keys_from_a_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nalpha\n\nbeta  # the second\n")
    assert Config(api_key_file=str(keys)).api_keys == ["alpha", "beta"]
    keys.write_text("# none\n")
    with pytest.raises(ConfigError, match="holds no key"):
        Config(api_key_file=str(keys))
    with pytest.raises(ConfigError, match="cannot read"):
        Config(api_key_file=str(tmp_path / "missing"))


def test_models_and_served_names(engine):
    """Several names (vLLM's --served-model-name a b): each is listed and answered, under the name asked for."""
    client = TestClient(build_app(engine, Config(served_model_names=["alias", "small"])))
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["alias", "small"] and data[0]["max_model_len"] == 64
    r = client.post("/v1/chat/completions", json=chat_body(model="small"))
    assert r.status_code == 200 and r.json()["model"] == "small"
    assert client.get("/v1/models/small").json()["id"] == "small"
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 404 and "'alias', 'small'" in r.json()["error"]["message"]


def test_any_model_name(engine):
    """--any-model-name answers to whatever name the client sends (llama.cpp's behaviour)."""
    client = TestClient(build_app(engine, Config(any_model_name=True)))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    for name in (MODEL, "claude-haiku-4-5", "gpt-5-codex"):
        r = client.post("/v1/chat/completions", json=chat_body(model=name))
        assert r.status_code == 200 and r.json()["model"] == name
    r = client.post("/v1/messages", json={"model": "claude-haiku-4-5", "max_tokens": 3,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "claude-haiku-4-5"


def test_errors_are_logged_and_counted_by_reason(client, caplog):
    """Every 4xx is logged with its reason (the field, never the prompt) and counted by route and reason."""
    secret = "the prompt text stays out of the log"
    with caplog.at_level("WARNING", logger="kvtier.server"):
        client.post("/v1/chat/completions", json=chat_body(model="nope"))
        client.post("/v1/chat/completions", json={**chat_body(), "bogus_field": 1,
                                                  "messages": [{"role": "user", "content": secret}]})
        client.post("/v1/chat/completions", json={**chat_body(), "temperature": "hot"})
        client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "POST /v1/chat/completions: 404 model_not_found: the model 'nope' does not exist" in logged
    assert "400 unsupported_field: bogus_field: kvtier does not support this field" in logged
    assert "400 invalid_field: temperature:" in logged and "400 invalid_json:" in logged
    assert secret not in logged
    text = client.get("/metrics").text
    for status, reason in (("404", "model_not_found"), ("400", "unsupported_field"), ("400", "invalid_field"),
                           ("400", "invalid_json")):
        assert (f'kvtier_request_errors_total{{endpoint="/v1/chat/completions",reason="{reason}",'
                f'status="{status}"}} 1.0') in text


def test_metrics_count_requests_and_tokens(client):
    client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    client.post("/v1/chat/completions", json=chat_body(model="nope"))
    text = client.get("/metrics").text
    assert 'kvtier_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'kvtier_requests_total{endpoint="/v1/chat/completions",status="404"} 1.0' in text
    assert "kvtier_generation_tokens_total 2.0" in text
    assert "kvtier_time_to_first_token_seconds_count 1.0" in text
    assert "kvtier_kv_pool_blocks_total 10.0" in text


def test_client_disconnect_aborts_non_streaming_request(engine):
    """A client that goes away while the engine works must not leave its request running."""
    engine.hang = True
    app = build_app(engine, Config())
    messages = [{"type": "http.request", "body": json.dumps(chat_body()).encode(), "more_body": False}]
    sent = []
    leaves_at = time.monotonic() + 0.3   # the client leaves while the engine is still busy

    async def receive():
        if messages:
            return messages.pop()
        if time.monotonic() < leaves_at:
            await asyncio.Event().wait()   # nothing to receive yet (the server polls with a timeout)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def main():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "server": ("testserver", 80), "client": ("testclient", 1)}
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
        await asyncio.sleep(0.05)   # let the cancelled generation unwind
    asyncio.run(main())
    assert sent[0]["status"] == 499
    assert engine.running == set()


@pytest.mark.parametrize("body, where", [
    (b'{"model": "stub-model", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    (b'{"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', "stop[0]"),
    (b'{"model": "stub-model", "prompt": "\\ud800\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_a_400_that_names_the_field(client, engine, body, where):
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    err = error_of(client.post(path, content=body, headers={"Content-Type": "application/json"}), 400)
    assert where in err["message"] and "Unicode" in err["message"]
    assert engine.requests == []


def test_bodies_over_the_limit_get_a_413_before_they_are_read(engine):
    client = TestClient(build_app(engine, Config(max_request_bytes=4096)))
    big = chat_body(messages=[{"role": "user", "content": "x" * 5000}])
    err = error_of(client.post("/v1/chat/completions", json=big), 413)
    assert err["code"] == "request_too_large" and "4096" in err["message"]

    def chunks():     # no Content-Length: counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    error_of(client.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert engine.requests and len(engine.requests) == 1


def test_a_prompt_too_long_for_certain_is_refused_before_tokenizing(client, engine):
    err = error_of(client.post("/v1/chat/completions",
                               json=chat_body(messages=[{"role": "user", "content": "y" * 100}])), 400)
    assert "at least 104 tokens" in err["message"]   # the role counts too and err["param"] == "messages"
    assert engine.requests == []


def test_an_anthropic_cache_control_breakpoint_pins_its_prefix_under_bounded_residency(client, engine):
    body = {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "sys", "cache_control":
                                                          {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "hello"}]}
    assert client.post("/v1/messages", json=body).status_code == 200
    assert engine.pins[-1] is None                      # no bounded residency: nothing to pin
    engine.max_pinned_tokens = 40
    assert client.post("/v1/messages", json=body).status_code == 200
    through_system = len("<system>sys<assistant>")      # the stub's template, generation prompt included
    assert engine.pins[-1] == [(0, through_system)]
    engine.max_pinned_tokens = 5
    client.post("/v1/messages", json=body)
    assert engine.pins[-1] == [(0, 5)]                  # as much as the budget allows


@pytest.mark.parametrize("n", [0, 17, 10**12])
def test_n_out_of_range_is_a_400_before_anything_is_set_up(client, engine, n):
    start = time.perf_counter()
    err = error_of(client.post("/v1/chat/completions", json=chat_body(n=n)), 400)
    assert err["param"] == "n" and time.perf_counter() - start < 1.0 and engine.requests == []
