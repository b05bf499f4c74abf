"""Tools and structured output through the official openai client against `kvtier serve` (bundled model):
forced and named calls match their schema, streamed calls arrive as OpenAI-shaped deltas, JSON replies
match their schema, and a six-turn tool loop restores all but its new messages from the cache."""
import json

import openai
import pytest
from conftest import API_KEY

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERT = {"type": "function", "function": {
    "name": "celsius_to_fahrenheit", "description": "Convert a temperature.",
    "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(agent_client):
    return agent_client


@pytest.fixture(scope="module")
def model(agent_model):
    return agent_model


def test_required_forces_a_call_that_matches_its_schema(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, CONVERT], tool_choice="required",
                                       max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "celsius_to_fahrenheit")
    arguments = json.loads(call.function.arguments)
    # the schema's required argument is there, of its type (the schemas allow more properties)
    required, kind = ("city", str) if call.function.name == "get_weather" else ("celsius", int | float)
    assert isinstance(arguments.get(required), kind), arguments


def test_a_named_tool_choice_calls_that_tool(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, CONVERT], max_tokens=64,
                                       temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "celsius_to_fahrenheit"}})
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "celsius_to_fahrenheit"
    assert isinstance(json.loads(call.function.arguments)["celsius"], int | float)


def test_streamed_calls_arrive_as_deltas_equal_to_the_whole(client, model):
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert not any("<tool_call>" in (c.choices[0].delta.content or "") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_auto(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=48, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40                # the tools are in the prompt
    message = auto.choices[0].message
    assert "<tool_call>" not in (message.content or "") or not message.tool_calls
    none = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    # the tools stay in the prompt (a tool loop's prefix never changes), and no call is read from the reply
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens and none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens_details.cached_tokens > 0


def test_json_schema_response_format(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(model=model, max_tokens=64, temperature=0,
                                       messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": schema}})
    reply = json.loads(r.choices[0].message.content)
    assert set(reply) == {"city", "population"} and isinstance(reply["population"], int)
    r = client.chat.completions.create(model=model, max_tokens=48, temperature=0, messages=ASK,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # llama.cpp's extension: json_object with its schema beside the type
    r = client.chat.completions.create(model=model, max_tokens=64, temperature=0, messages=ASK,
                                       response_format={"type": "json_object", "schema": schema})
    assert set(json.loads(r.choices[0].message.content)) == {"city", "population"}


def test_invalid_schemas_and_tool_choices_are_400s(client, model):
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "other"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model=model, messages=ASK, tool_choice="required", max_tokens=4)


def test_legacy_functions(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, functions=[WEATHER["function"]],
                                       function_call={"name": "get_weather"}, max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "get_weather"
    assert "city" in json.loads(choice.message.function_call.arguments)


def test_a_six_turn_tool_loop_restores_everything_but_its_new_messages(client, model):
    messages = [{"role": "system", "content": "You help with weather questions."},
                {"role": "user", "content": "Check the weather in six cities, one at a time."}]
    prompt_tokens, cached = [], []
    for turn in range(6):
        r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CONVERT], max_tokens=48,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
        prompt_tokens.append(r.usage.prompt_tokens)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        call = r.choices[0].message.tool_calls[0]
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"Sunny, {20 + turn} C."})
    for n in range(1, 6):
        # everything of the previous turn's prompt but its last partial block comes back from the cache
        assert cached[n] >= prompt_tokens[n - 1] // 64 * 64, (n, prompt_tokens, cached)
        assert prompt_tokens[n] - cached[n] < 64 + 40, (n, prompt_tokens, cached)   # the new messages, at most


def test_a_langchain_agent_completes_a_two_tool_loop(agent_server, model):
    """LangChain's ChatOpenAI with bind_tools: forced calls of two tools, their results fed back, then a
    final answer; every turn after the first restores the conversation so far from the cache."""
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city, in degrees Celsius."""
        return f"{city}: sunny, 21 C"

    @tool
    def celsius_to_fahrenheit(celsius: float) -> float:
        """Convert degrees Celsius to Fahrenheit."""
        return celsius * 9 / 5 + 32

    tools = {t.name: t for t in (get_weather, celsius_to_fahrenheit)}
    url, log = agent_server
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key=API_KEY, model=model, temperature=0, max_tokens=64,
                     max_retries=0)
    messages = [HumanMessage("What is the weather in Paris, in Fahrenheit?")]
    cached = []
    for forced in ("get_weather", "celsius_to_fahrenheit", "none"):
        reply = llm.bind_tools(list(tools.values()), tool_choice=forced).invoke(messages)
        cached.append(reply.usage_metadata["input_token_details"].get("cache_read", 0))
        messages.append(reply)
        if forced == "none":
            break
        call, = reply.tool_calls
        assert call["name"] == forced
        messages.append(tools[call["name"]].invoke(call))      # runs the tool: its arguments fit its signature
    assert messages[-1].content and not messages[-1].tool_calls
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai", "tool", "ai"]
    # the first turn shares at most the chat template's opening with earlier requests; each later turn reuses
    # everything before its new messages
    assert cached[0] < 64 and all(c > 64 for c in cached[1:]), cached
    finished = [line for line in log.read_text().splitlines() if " prompt tokens (" in line][-3:]
    assert all("from device" in line for line in finished[1:]), finished
