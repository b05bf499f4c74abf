"""The Anthropic Messages API through the official anthropic client against `kvtier serve` (bundled model):
text, streaming events, tool use (forced and streamed), a tool loop restored from the cache, count_tokens,
and Anthropic-shaped errors."""
import json

import anthropic
import httpx
import pytest
from conftest import API_KEY

pytestmark = pytest.mark.integration

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}     # the current client no longer takes sampling arguments; the API still does


@pytest.fixture(scope="module")
def server(agent_server):
    return agent_server[0]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server}/v1/models", headers={"x-api-key": API_KEY}).json()["data"][0]["id"]


def test_text_message_and_its_stream(client, model):
    kwargs = dict(model=model, max_tokens=16, messages=ASK, extra_body=GREEDY, system="You are a concise geography assistant. " * 8 + "Answer in one word.")
    message = client.messages.create(**kwargs)
    assert message.role == "assistant" and message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 10
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.stop_reason == message.stop_reason
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.usage.cache_read_input_tokens > 0        # the same prompt again: restored from the cache


def test_stop_sequences_say_which_one(client, model):
    free = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Count from 1 to 20."}])
    text = free.content[0].text
    stop = next(s for s in (" 5", "5", " 3", "3") if s in text)
    cut = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "Count from 1 to 20."}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_forced_tool_use_and_a_tool_loop(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.messages.create(model=model, max_tokens=64, extra_body=GREEDY, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    use, = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    assert use.id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    count = client.messages.count_tokens(model=model, messages=messages, tools=[WEATHER])
    answer = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=messages, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.content and answer.content[0].type == "text" and answer.stop_reason != "tool_use"
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == count.input_tokens
    assert usage.cache_read_input_tokens >= reply.usage.input_tokens + reply.usage.cache_read_input_tokens - 64


def test_streamed_tool_use(client, model):
    kwargs = dict(model=model, max_tokens=64, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "any"},
                  messages=[{"role": "user", "content": "Weather in Lyon?"}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in whole.content]
    assert final.content[-1].input == whole.content[-1].input and final.stop_reason == "tool_use"
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)


def test_thinking_in_the_history_is_accepted(client, model):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet back", "signature": "x"},
                                                  {"type": "text", "text": "Hello!"}]},
                {"role": "user", "content": "How are you?"}]
    assert client.messages.create(model=model, max_tokens=8, messages=messages).content


def test_errors_have_anthropics_shape(server, client, model):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body={"temperature": 7})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=8, messages=ASK)
    r = httpx.post(f"{server}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": model, "max_tokens": 8, "messages": ASK, "not_a_field": 1})
    assert r.status_code == 400 and "not_a_field" in r.json()["error"]["message"]


def claude_code_shaped(cch: str, **more) -> dict:
    """What Claude Code sends: a billing-header system block that may change per request, a long cached
    system prompt, a system message inside the conversation, max_tokens of 64000, adaptive thinking and hints."""
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197; cch={cch};"},
              {"type": "text", "text": "You are a coding agent. " * 300, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "List the files here.",
                                              "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Available agent types: none."}]
    return {"system": system, "messages": messages, "max_tokens": 64000, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"}, **more}


def test_claude_code_shaped_requests_share_their_prefix(server, model):
    """Served, with max_tokens capped to what the 2048-token context has room for; the billing header is
    left out of the prompt, so a request with another cch= value reuses the whole prefix."""
    tools = [WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    headers = {"x-api-key": API_KEY, "anthropic-beta": "context-management-2025-06-27"}
    usages = []
    for cch in ("a1b2c", "f9e8d"):
        body = claude_code_shaped(cch, model=model, tools=tools, temperature=0,
                                  mcp_servers=[{"type": "url", "url": "http://127.0.0.1:9", "name": "x"}])
        r = httpx.post(f"{server}/v1/messages", headers=headers, json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["stop_reason"] in ("end_turn", "max_tokens")
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] <= 2048
        usages.append(usage)
    assert usages[1]["input_tokens"] < 64 <= usages[1]["cache_read_input_tokens"]


def test_output_config_format_is_a_json_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    message = client.messages.create(model=model, max_tokens=48, messages=ASK, extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert set(json.loads(message.content[0].text)) == {"city"}


def test_an_image_is_a_400_naming_it(server, model):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    r = httpx.post(f"{server}/v1/messages", headers={"x-api-key": API_KEY}, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
