"""Fuzzing the real server (a tiny random model) from its own OpenAPI schema, with schemathesis's valid and
invalid request strategies: no body gets a 5xx or stalls, and the server is healthy and idle afterwards."""
import json

import httpx
import pytest
import schemathesis
from conftest import IDLE_GAUGES, kvtier_server, sse_events, wait_until_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    args = ["--model", tiny_model_dir, "--max-model-len", "128", "--kv-pool-tokens", "4096", "--api-key", API_KEY,
            "--kv-host-gib", "0.05", "--kv-disk-dir", str(tmp_path_factory.mktemp("fuzz-kv"))]
    with kvtier_server(args, tmp_path_factory.mktemp("fuzz") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def operations(server_url):
    spec = httpx.get(f"{server_url}/openapi.json", headers=AUTH).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(spec)
    return [schema["/v1/chat/completions"]["POST"], schema["/v1/completions"]["POST"]]


@pytest.fixture(scope="module")
def model(server_url):
    return httpx.get(f"{server_url}/v1/models", headers=AUTH).json()["data"][0]["id"]


@given(data=st.data())
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_body_gets_a_5xx(data, operations, server_url, model):
    operation, mode = data.draw(st.sampled_from(operations)), data.draw(st.sampled_from(MODES))
    case = data.draw(operation.as_strategy(generation_mode=mode))
    if isinstance(case.body, dict) and data.draw(st.booleans()):
        case.body["model"] = model        # else nearly every body stops at the model check
    response = case.call(base_url=server_url, headers=AUTH, timeout=60)
    assert response.status_code < 500, f"{response.status_code} for {case.body!r:.500}: {response.text[:500]}"
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


EDGE_NUMBERS = [0, 5e-324, 1e-40, 1e-46, 3.0e38, 1e308, -1e308, -1, 2**63, -2**63 - 1, 2**64, float("nan"),
                float("inf")]
NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "seed", "presence_penalty", "frequency_penalty",
                  "top_logprobs", "logprobs"]


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_edge_numbers_in_every_sampling_field(server_url, model, field):
    """The values a fuzzer finds in the end (float32 underflow and overflow, 64-bit edges, NaN) tried at once."""
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=60) as http:
        for value in EDGE_NUMBERS:
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                               ("/v1/completions", {"prompt": "Once upon a time"})):
                body = {"model": model, "max_tokens": 4, **body, field: value}
                if field == "top_logprobs":
                    body["logprobs"] = True
                for stream in (False, True):
                    r = http.post(path, content=json.dumps({**body, "stream": stream}),   # NaN as Python writes it
                                  headers={"Content-Type": "application/json"})
                    assert r.status_code < 500, f"{field}={value!r} on {path}: {r.status_code} {r.text[:300]}"
                    if stream and r.status_code == 200:     # ends with [DONE], and no event is an error
                        assert not [event for event in sse_events(r.text) if "error" in event], r.text


def test_healthy_and_idle_after_fuzzing(server_url):
    assert httpx.get(f"{server_url}/health", timeout=5).status_code == 200
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=30) as http:
        metrics = wait_until_idle(http)
        assert {name: metrics.get(name, 0) for name in IDLE_GAUGES} == dict.fromkeys(IDLE_GAUGES, 0)
        generated = sum(v for k, v in metrics.items()
                        if k.startswith("kvtier_requests_total") and 'status="200"' in k and "/v1/" in k)
        assert generated > 0      # the fuzzer reached generation, not only validation
