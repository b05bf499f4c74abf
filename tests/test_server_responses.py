"""The OpenAI Responses API through the official openai client against `kvtier serve` (bundled model):
text and its stream, forced function calls, continuing by previous_response_id (restoring the KV), a 404
for an unknown id, and kept responses that outlive a restart."""
import openai
import pytest

from kvtier.server.responses import ResponseStore

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
INSTRUCTIONS = "You are a helpful travel assistant. " * 16


def test_text_and_its_stream(agent_client, agent_model):
    kwargs = dict(model=agent_model, instructions=INSTRUCTIONS, input="What is the capital of France?",
                  max_output_tokens=16, temperature=0)
    r = agent_client.responses.create(**kwargs)
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete") and "Paris" in r.output_text
    assert r.usage.input_tokens > 40 and r.usage.output_tokens > 0
    events = list(agent_client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0    # the same prompt, cached


def test_a_function_call_continued_by_previous_response_id(agent_client, agent_model):
    first = agent_client.responses.create(model=agent_model, instructions=INSTRUCTIONS, input="Weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", max_output_tokens=48, temperature=0)
    call, = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in call.arguments and call.call_id
    second = agent_client.responses.create(model=agent_model, instructions=INSTRUCTIONS, previous_response_id=first.id,
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=16, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 C"}])
    assert second.output_text and second.previous_response_id == first.id
    # the conversation so far is restored from the cache, not recomputed
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 64 * 64


def test_an_unknown_previous_response_is_a_404(agent_client, agent_model):
    with pytest.raises(openai.NotFoundError) as e:
        agent_client.responses.create(model=agent_model, input="hi", previous_response_id="resp_unknown")
    assert e.value.code == "previous_response_not_found"


def test_kept_responses_outlive_a_restart_and_damage_is_a_miss(tmp_path):
    """What a restarted server reads: the files the store wrote (the KV itself comes back from the disk tier,
    as tests/test_server_cache.py shows)."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    store = ResponseStore(str(tmp_path))
    store.put("resp_abc", conversation)
    store.flush()
    assert oct((tmp_path / "resp_abc.json").stat().st_mode & 0o777) == "0o600"
    again = ResponseStore(str(tmp_path))
    assert again.get("resp_abc") == conversation and again.get("resp_other") is None
    assert again.get("../../etc/passwd") is None                   # ids never reach outside the directory
    (tmp_path / "resp_bad.json").write_text("{not json")
    assert again.get("resp_bad") is None


PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
GROUP = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]}


# a task the bundled model answers with a short patch (its freeform call ends within max_output_tokens)
TASK = "Fix the bug in main.py."


def test_codex_shaped_requests(agent_client, agent_model):
    """What Codex CLI sends: a freeform tool (called, and answered as a custom tool call), a namespace of
    functions, a hosted web search (left out), and its hints; then the call's output and a reasoning item."""
    hints = dict(store=False, include=["reasoning.encrypted_content"], prompt_cache_key="thread-1",
                 reasoning={"summary": "auto"}, text={"verbosity": "low"},
                 client_metadata={"session_id": "thread-1"}, service_tier="auto", parallel_tool_calls=True)
    tools = [WEATHER, PATCH, GROUP, {"type": "web_search", "external_web_access": True}]
    first = agent_client.responses.create(model=agent_model, instructions=INSTRUCTIONS, input=TASK,
                                          tools=tools, tool_choice={"type": "custom", "name": "apply_patch"},
                                          max_output_tokens=48, temperature=0, extra_body=hints)
    call, = first.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and isinstance(call.input, str)
    history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]},
               {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "A patch."}],
                "encrypted_content": "opaque"},
               {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": call.input},
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"},
               {"type": "web_search_call", "id": "ws_1", "status": "completed"}]
    second = agent_client.responses.create(model=agent_model, instructions=INSTRUCTIONS, input=history,
                                           tools=tools, max_output_tokens=8, temperature=0, extra_body=hints)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 64 * 64 - 64


@pytest.mark.parametrize("change, named", [
    ({"tools": [{"type": "teleport"}]}, "tools[0]: tools of type 'teleport'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"background": True}, "background"),
])
def test_what_kvtier_cannot_answer_is_a_400_naming_it(agent_client, agent_model, change, named):
    with pytest.raises(openai.BadRequestError) as e:
        agent_client.responses.create(**{"model": agent_model, "input": "hi", "max_output_tokens": 4, **change})
    assert named in e.value.message
