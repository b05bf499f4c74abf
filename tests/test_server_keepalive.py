"""A stream whose prompt takes longer than --sse-keepalive answers before its first token and sends SSE comments
while it waits (a Responses stream answers with its first output): the official clients parse it as any stream, and
a client that leaves meanwhile aborts it."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from conftest import kvtier_server, wait_until_idle
from openai import OpenAI

pytestmark = pytest.mark.integration

# a prompt of ~1000 tokens in chunks of 64 a step: its first token comes many keep-alive periods after the request,
# on a GPU too (16 eager steps of a few milliseconds each)
LONG = "Here are my notes. " + " ".join(f"Item {i} is on shelf {i % 7}." for i in range(120)) + \
    " Which shelf holds item 3? Answer briefly."
MESSAGES = [{"role": "user", "content": LONG}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    args = ["--kv-pool-tokens", "4096", "--max-model-len", "2048", "--max-batched-tokens", "64", "--no-prefix-cache",
            "--sse-keepalive", "0.01", "--any-model-name"]
    with kvtier_server(args, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def stream_lines(http, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_chat_stream_answers_before_its_first_token_and_keeps_the_line_alive(http, base_url):
    body = {"model": "any", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    lines = stream_lines(http, "/v1/chat/completions", body)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data > 0 and all(line == ": keep-alive" for line in lines[:first_data])
    streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in lines if line.startswith("data: {"))
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert streamed == whole and whole
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    chunks = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_anthropics_client_reads_such_streams_and_a_responses_stream_answers_with_its_first_event(http, base_url):
    claude = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    lines = stream_lines(http, "/v1/messages", {"model": "any", "max_tokens": 8, "messages": MESSAGES})
    assert lines[0] == ": keep-alive" and any(line == "event: message_start" for line in lines)
    greedy = dict(model="any", max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0})
    with claude.messages.stream(**greedy) as stream:
        streamed = stream.get_final_text()
    assert streamed == claude.messages.create(**greedy).content[0].text
    # Codex's watchdog counts events from the answer on: a Responses stream answers with its first output
    assert stream_lines(http, "/v1/responses", {"model": "any", "input": LONG, "max_output_tokens": 8})[0] == \
        "event: response.created"
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    events = list(client.responses.create(model="any", input=LONG, max_output_tokens=8, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == client.responses.create(
        model="any", input=LONG, max_output_tokens=8, temperature=0).output_text


def test_a_client_that_leaves_before_the_first_token_aborts_its_request(http):
    body = {"model": "any", "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert next(line for line in r.iter_lines() if line) == ": keep-alive"
    m = wait_until_idle(http)
    assert (m["kvtier_requests_running"], m["kvtier_kv_pool_blocks_used"]) == (0, 0)


def test_a_rejected_stream_still_gets_a_400(http):
    body = {"model": "any", "messages": [{"role": "user", "content": LONG * 3}], "stream": True}    # > 2048 tokens
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
