"""The real server (bundled model) under abuse: poisoned requests beside live streams, a large body
beside /health, API keys from the environment and a file, tenants that never see each other's prefixes,
a short concurrent load that returns to idle, and kill -9 while the disk tier is being written."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import IDLE_GAUGES, kvtier_server, wait_until_idle

pytestmark = pytest.mark.integration

KEYS = ("tenant-a-key", "tenant-b-key")
ENV_KEY = "key-from-the-environment"
STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server whose keys come from a file and the environment; each key is its own cache tenant."""
    tmp = tmp_path_factory.mktemp("hardening")
    (tmp / "keys").write_text("# one key per line\n" + "\n".join(KEYS) + "\n")
    args = ["--kv-pool-tokens", "16384", "--max-model-len", "2048", "--api-key-file", str(tmp / "keys"),
            "--cache-salt-from-api-key", "--max-request-bytes", str(32 << 20), "--kv-disk-dir", str(tmp / "kv"),
            "--quantize", "none"]      # greedy replies equal to the token whether their prompt was cached or not
    started = {}
    with kvtier_server(args, tmp / "server.log", env={"KVTIER_API_KEY": ENV_KEY},
                       on_start=lambda proc: started.update(pid=proc.pid)) as url:
        yield url, started["pid"]


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def stream_text(http, body) -> tuple[str, str | None, bool]:
    """(text, finish_reason, ended with [DONE]) of a streamed chat completion."""
    text, finish, done = "", None, False
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                choice = event["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish, done


def test_poisoned_requests_beside_six_streams(http, model):
    bodies = [{"model": model, "max_tokens": 24, "temperature": 0,
               "messages": [{"role": "user", "content": f"Write one sentence about the number {i}."}]}
              for i in range(6)]
    alone = [stream_text(http, body)[0] for body in bodies]
    poison = [{"temperature": 1e-40}, {"top_p": 1e-46}, {"temperature": 5e-324, "top_p": 5e-324},
              {"temperature": 1e-40, "top_k": 1, "seed": -2**63}]
    with ThreadPoolExecutor(10) as pool:
        streams = [pool.submit(stream_text, http, body) for body in bodies]
        poisoned = [pool.submit(http.post, "/v1/chat/completions",
                                json={"model": model, "messages": STORY, "max_tokens": 16, **p}) for p in poison]
        results = [s.result() for s in streams]
        answers = [p.result() for p in poisoned]
    assert [r[0] for r in results] == alone
    assert all(finish in ("stop", "length") and done for _, finish, done in results)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    greedy = answers[0].json()["choices"][0]["message"]["content"]
    assert all(a.json()["choices"][0]["message"]["content"] == greedy for a in answers)   # each is greedy


def health_latencies(url, until: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while not until.is_set():
            start = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    return latencies


@pytest.mark.parametrize("chars, status", [(10_000_000, 400), (150_000, 400), (40_000_000, 413)])
def test_health_answers_while_a_large_body_is_processed(url, http, model, chars, status):
    """10 MB: refused as too long for certain before tokenizing; 150 KB: tokenized off the event loop, then
    refused; 40 MB: over --max-request-bytes, a 413 before it is read."""
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * (chars // 5)}]}
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(health_latencies, url, done)
        time.sleep(0.2)
        r = http.post("/v1/chat/completions", json=body)
        done.set()
        latencies = probe.result()
    assert r.status_code == status, r.text[:300]
    assert "maximum context length" in r.text or status == 413
    assert len(latencies) >= 3 and max(latencies) < 0.5, latencies


def test_keys_from_a_file_and_the_environment_stay_out_of_the_process_list(server, model):
    url, pid = server
    for key in (*KEYS, ENV_KEY):
        r = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": key}, timeout=60,
                       json={"model": model, "messages": STORY, "max_tokens": 2})
        assert r.status_code == 200, (key, r.text)
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": f"bearer {ENV_KEY}"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().decode()
    assert not any(key in cmdline for key in (*KEYS, ENV_KEY))


def test_tenants_never_see_each_others_prefixes(url, model):
    secret = [{"role": "user", "content": "My PIN is 4729. " + "Please keep it safe for me. " * 30}]
    body = {"model": model, "messages": secret, "max_tokens": 2, "temperature": 0}

    def cached(key, **extra):
        r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={**body, **extra})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    opening = cached(KEYS[0])                    # at most the chat template's opening, from this tenant's own past
    assert opening < 64
    assert cached(KEYS[0]) > opening + 64        # the same tenant reuses its prefix
    assert cached(KEYS[1]) <= opening            # another tenant learns nothing of the secret from cached_tokens
    assert cached(KEYS[1], cache_salt="x") == 0  # nor with a salt of its own
    assert cached(KEYS[0], cache_salt="y") == 0  # a salt splits one tenant's cache further


def test_short_concurrent_load_returns_to_idle(http, model):
    def ask(i):
        body = {"model": model, "max_tokens": 8 + i % 5, "temperature": 0.7, "seed": i, "stream": i % 2 == 0,
                "messages": [{"role": "user", "content": f"Question {i}: " + "why is the sea salty? " * (i % 7)}]}
        if i % 2 == 0:
            return stream_text(http, body)[2]
        return http.post("/v1/chat/completions", json=body).status_code == 200
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(ask, range(48)))
    metrics = wait_until_idle(http, timeout=30)
    assert {name: metrics.get(name, 0) for name in IDLE_GAUGES} == dict.fromkeys(IDLE_GAUGES, 0)
    assert metrics["kvtier_kv_tier_bytes_used{tier=\"host\"}"] <= metrics["kvtier_kv_tier_budget_bytes{tier=\"host\"}"]


def test_sigterm_lets_the_saves_in_flight_land_before_the_process_ends(tmp_path):
    """docker stop, systemd and kill send SIGTERM: the server stops serving, its engine's queued saves land (uvicorn
    raises the signal again once it stops, which would otherwise end the process there: it logged no stop), and then
    it dies of the signal. A restart finds every full block of the last prompt on disk, and no temp file is left."""
    args = ["--kv-pool-tokens", "8192", "--max-model-len", "4096", "--kv-disk-dir", str(tmp_path / "kv")]
    messages = [{"role": "user", "content": "Ledger: " + " ".join(f"entry {i} holds {i * 7 % 1000} coins." for i in
                                                                   range(300)) + " Which entry holds the most?"}]
    procs = {}
    with kvtier_server(args, tmp_path / "first.log", on_start=lambda p: procs.update(first=p)) as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
            prompt_tokens = client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
        procs["first"].send_signal(signal.SIGTERM)     # as the answer arrives: its blocks are still being saved
        assert procs["first"].wait(30) == -signal.SIGTERM
    assert "kvtier stopped: the engine's queued saves have landed" in (tmp_path / "first.log").read_text()
    assert not list(tmp_path.glob("kv/**/*.tmp"))
    with kvtier_server(args, tmp_path / "second.log") as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert prompt_tokens > 1500 and usage["prompt_tokens_details"]["cached_tokens"] >= (prompt_tokens - 1) // 64 * 64


def test_kill_during_disk_writes_then_restart_answers_as_cold(tmp_path):
    """kill -9 while long prompts are being prefilled and their blocks written through to disk; the restart
    serves what landed and recomputes the rest, and every answer equals a cold computation."""
    args = ["--kv-pool-tokens", "16384", "--max-model-len", "2048", "--kv-disk-dir", str(tmp_path / "kv")]
    prompts = [[{"role": "user", "content": f"Document {i}: " + f"The tide rose over stone number {i}. " * 60
                 + "Summarize the document in one sentence."}] for i in range(2)]
    procs = {}
    with kvtier_server(args, tmp_path / "first.log", on_start=lambda p: procs.update(first=p)) as url:
        client = httpx.Client(base_url=url, timeout=120)
        model = client.get("/v1/models").json()["data"][0]["id"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(client.post, "/v1/chat/completions",
                                   json={"model": model, "messages": p, "max_tokens": 200, "temperature": 0})
                       for p in prompts]
            while not any(list(tmp_path.glob("kv/*/*.kvb"))):     # writes have begun
                time.sleep(0.01)
            time.sleep(0.5)
            procs["first"].send_signal(signal.SIGKILL)
            for f in futures:
                with pytest.raises(httpx.TransportError):
                    f.result()
    assert procs["first"].wait(10) == -signal.SIGKILL
    with kvtier_server(args, tmp_path / "second.log") as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            def ask(messages, **extra):
                body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
                return client.post("/v1/chat/completions", json=body).json()
            warm = [ask(p) for p in prompts]
            cold = [ask(p, cache_salt="fresh") for p in prompts]     # a salt no block was saved under
    assert sum(w["usage"]["prompt_tokens_details"]["cached_tokens"] for w in warm) > 0   # some writes landed
    assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for c in cold)
    assert [w["choices"][0]["message"]["content"] for w in warm] == \
           [c["choices"][0]["message"]["content"] for c in cold]
    assert not list(tmp_path.glob("kv/**/*.tmp"))        # the dead writer's temp files are gone
