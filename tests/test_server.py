"""The real server (`kvtier serve`, bundled model) driven by the official openai client and httpx."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from conftest import kvtier_server, scrape, wait_until_idle
from openai import OpenAI

pytestmark = pytest.mark.integration

API_KEY = "test-key"
MAX_MODEL_LEN = 2048
# not "What is the capital of France?": its first token nearly ties ("The", "L"), which quantized weights may break either way
QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]
COUNTING = "Count from 1 to 500: 1, 2, 3, 4, 5,"   # the model keeps counting: never stops on its own early


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    """One `kvtier serve` per module; every /v1 call must carry API_KEY."""
    args = ["--kv-pool-tokens", "8192", "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY]
    with kvtier_server(args, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def test_health_needs_no_key(base_url):
    r = httpx.get(f"{base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_an_idle_connection_outlives_the_clients_keep_alive(base_url):
    """A connection idle past the 5 s httpx (the SDKs) keeps one is still open: a client never reuses one that the
    server is closing at that moment (a request lost as "Server disconnected" under load)."""
    conn = HTTPConnection(urlsplit(base_url).netloc, timeout=30)
    try:
        for pause in (0, 6):
            time.sleep(pause)
            conn.request("GET", "/health")        # http.client opens no new connection for a closed one: it raises
            assert conn.getresponse().read() == b'{"status":"ok"}'
    finally:
        conn.close()


def test_models(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_chat_greedy(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 12 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert (choice.finish_reason == "length") == (u.completion_tokens == 12)
    again = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0).usage
    assert u.prompt_tokens // 64 * 64 <= again.prompt_tokens_details.cached_tokens < again.prompt_tokens


def test_streaming_chat_equals_non_streaming(client, model):
    kwargs = dict(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_length_and_streaming(client, model):
    kwargs = dict(model=model, prompt=COUNTING, max_tokens=5, temperature=0)
    r = client.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == r.choices[0].text


def test_completions_token_id_prompt(client, model):
    ids = list(range(1000, 1020))
    r = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens > 0


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt=COUNTING, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text


def test_stop_string_cuts_the_output(client, model):
    kwargs = dict(model=model, prompt=COUNTING, max_tokens=12, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    stop = " 8,"
    assert stop in free, free
    r = client.completions.create(**kwargs, stop=[stop, "never-appears"])
    assert r.choices[0].text == free[:free.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == r.choices[0].text and stop not in streamed


def test_same_seed_same_sample(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
                  temperature=1.0, seed=1234)
    first, second = (client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2))
    assert first == second


def test_n_choices_share_the_prompt(client, model, http):
    story = [{"role": "user", "content": "Tell me a story about a dragon who learns to sing. " * 4}]
    r = client.chat.completions.create(model=model, messages=story, n=3, max_tokens=12, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1
    assert 3 <= r.usage.completion_tokens <= 36
    fresh = [{"role": "user", "content": "Describe a lighthouse on a stormy night, in detail. " * 4}]
    before = scrape(http)["kvtier_cached_prompt_tokens_total"]
    chunks = list(client.chat.completions.create(model=model, messages=fresh, n=2, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts[0] == texts[1] and texts[0]                 # greedy choices agree
    assert chunks[-1].usage.completion_tokens == 12
    # the prompt is computed once: the second choice takes at least all its full blocks from the first (the rest
    # of the prompt but its last token too when the first has finished by then and left its partial block); the
    # first choice may find the chat template's opening tokens kept by an earlier request
    prompt_tokens = chunks[-1].usage.prompt_tokens
    full_blocks = (prompt_tokens - 1) // 64 * 64
    assert full_blocks > 0
    assert full_blocks <= scrape(http)["kvtier_cached_prompt_tokens_total"] - before <= 2 * (prompt_tokens - 1)


def test_concurrent_requests(client, model):
    def ask(i):
        return client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": f"Say the number {i}."}])
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ask, range(4)))
    assert len({r.id for r in results}) == 4
    assert all(r.usage.completion_tokens > 0 and r.choices[0].message.content for r in results)


def test_client_errors(base_url, client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model, messages=QUESTION, temperature=5)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt="hello " * (MAX_MODEL_LEN + 10), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 16"):
        client.chat.completions.create(model=model, messages=QUESTION, n=17)
    wrong = OpenAI(base_url=f"{base_url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    assert httpx.get(f"{base_url}/v1/models").status_code == 401


@pytest.mark.parametrize("content, param", [(b'{"model": "m", "messages": [', None), (b'{"messages": []}', "model")])
def test_malformed_requests_get_400_error_objects(http, content, param):
    r = http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_unknown_route_is_404_error_object(http):
    r = http.post("/v1/nothing-here", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_metrics_move(http, client, model):
    before = scrape(http)
    client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, temperature=0)
    after = scrape(http)
    ok = 'kvtier_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[ok] == before.get(ok, 0) + 1
    assert after["kvtier_generation_tokens_total"] > before["kvtier_generation_tokens_total"]
    assert after["kvtier_prompt_tokens_total"] > before["kvtier_prompt_tokens_total"]
    assert after["kvtier_time_to_first_token_seconds_count"] == before["kvtier_time_to_first_token_seconds_count"] + 1
    assert after["kvtier_kv_pool_blocks_total"] == 8192 // 64
    for name in ("kvtier_time_per_output_token_seconds_count", "kvtier_request_latency_seconds_count",
                 "kvtier_kv_pool_usage_ratio", "kvtier_requests_waiting"):
        assert name in after


def test_streaming_disconnect_aborts_the_request(http, model):
    body = {"model": model, "prompt": COUNTING, "max_tokens": 1000, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line]
        assert received and all(line.startswith("data: {") for line in received)
        assert scrape(http)["kvtier_requests_running"] == 1
    # leaving the block closed the connection mid-stream
    m = wait_until_idle(http)
    assert (m["kvtier_requests_running"], m["kvtier_kv_pool_blocks_used"]) == (0, 0)


def test_non_streaming_disconnect_aborts_the_request(http, model):
    body = {"model": model, "prompt": COUNTING, "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.0)
    m = wait_until_idle(http)
    assert (m["kvtier_requests_running"], m["kvtier_kv_pool_blocks_used"]) == (0, 0)
    assert m['kvtier_requests_total{endpoint="/v1/completions",status="499"}'] >= 1
