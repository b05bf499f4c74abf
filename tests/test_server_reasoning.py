"""Reasoning models: <think> output read apart from the content on all three APIs, the thinking switch
reaching the chat template, and thinking in the history rendered as the template wants. The server runs a
tiny random Qwen3 with Qwen3's real chat template; its replies are scripted by constrained decoding
($KVTIER_TEST_SCRIPT), since a random model never writes a think block of its own."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from conftest import API_KEY, kvtier_server

from kvtier.server.reasoning import ReplyReader, reasoning_parser_for_template, starts_inside
from kvtier.server.tool_parsers import PARSERS

THOUGHT, ANSWER = "The user greets me.\nI greet back.", "Hello there!"
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
ASK = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("inside, text", [(None, REPLY), (True, REPLY.removeprefix("<think>"))])
def test_reader_splits_whole_and_streamed_alike(inside, text):
    call = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
    whole = ReplyReader(True, inside, PARSERS["hermes"]).read(text + call)
    assert (whole.reasoning, whole.content) == (THOUGHT, ANSWER)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("ls", {"path": "."})]
    reader = ReplyReader(True, inside, PARSERS["hermes"])
    parts = [reader.feed(c) for c in text + call] + [reader.feed("", final=True)]
    assert "".join(p.reasoning for p in parts) == THOUGHT and "".join(p.content for p in parts) == ANSWER
    assert [c.name for p in parts for c in p.calls] == ["ls"]


def test_reader_without_a_block():
    assert ReplyReader(True, None, None).read("Just words.").content == "Just words."      # qwen3: no block opened
    assert ReplyReader(True, True, None).read("cut off while thinking").reasoning == "cut off while thinking"
    assert ReplyReader(True, False, None).read(REPLY).content == REPLY                     # the prompt closed it
    assert ReplyReader(False, None, None).read(REPLY).content == REPLY                     # no reasoning parser


def test_parser_chosen_from_the_template(qwen3_tokenizer, bundled_tokenizer):
    ask = qwen3_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert reasoning_parser_for_template(qwen3_tokenizer.chat_template, ask) == "qwen3"
    assert reasoning_parser_for_template("{{ '<think>\\n' }}", "<|assistant|>\n<think>\n") == "deepseek_r1"
    assert reasoning_parser_for_template(bundled_tokenizer.chat_template, "") is None
    assert starts_inside("qwen3", "assistant\n<think>\n") is True
    assert starts_inside("deepseek_r1", "assistant\n<think>\n\n</think>\n\n") is False
    assert starts_inside("qwen3", "assistant\n") is None and starts_inside("deepseek_r1", "assistant\n") is True


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    script = tmp / "script.json"
    script.write_text(json.dumps([{"tool": "get_time", "reply": '<tool_call>\n{"name":"get_time","arguments":{}}'
                                                                  '\n</tool_call>'}, {"reply": REPLY}]))
    args = ["--model", tiny_qwen3_dir, "--kv-pool-tokens", "8192", "--no-kv-disk", "--served-model-name", "qwen3"]
    with kvtier_server(args, tmp / "server.log", env={"KVTIER_TEST_SCRIPT": str(script)}) as url:
        yield url


def test_chat_completions_reasoning_content(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    message = client.chat.completions.create(model="qwen3", messages=ASK).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    chunks = list(client.chat.completions.create(model="qwen3", messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_thinking_switch_reaches_the_template(server):
    """Off, Qwen3's template writes an empty block into the prompt: the reply is then all content."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    on = client.chat.completions.create(model="qwen3", messages=ASK)
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = client.chat.completions.create(model="qwen3", messages=ASK, extra_body=off)
        assert r.usage.prompt_tokens > on.usage.prompt_tokens
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "qwen3", "messages": ASK,
                                                          "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_anthropic_thinking_blocks(server):
    client = anthropic.Anthropic(base_url=server, api_key="unused")
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        message = client.messages.create(model="qwen3", max_tokens=64, messages=ASK, thinking=thinking)
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == THOUGHT and message.content[0].signature
        assert message.content[1].text == ANSWER
    with client.messages.stream(model="qwen3", max_tokens=64, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT
    assert final.content[0].signature == message.content[0].signature
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert {"thinking_delta", "signature_delta", "text_delta"} <= set(kinds)


def test_anthropic_thinking_in_a_tool_loop_reaches_the_template(server):
    """Qwen3's template renders the thinking of the turn in progress: a longer thought, a longer prompt."""
    def prompt_tokens(thought: str) -> int:
        messages = [{"role": "user", "content": "What time is it?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": thought, "signature": "sig"},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}]}]
        tools = [{"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
        r = httpx.post(f"{server}/v1/messages/count_tokens",
                       json={"model": "qwen3", "messages": messages, "tools": tools})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]
    assert prompt_tokens("I should look at the clock before I answer.") > prompt_tokens("Clock.")


def test_responses_reasoning_items(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    r = client.responses.create(model="qwen3", input="Hi", reasoning={"effort": "medium", "summary": "auto"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    follow = client.responses.create(model="qwen3", input="And again?", previous_response_id=r.id)
    assert follow.output_text == ANSWER
    r = httpx.post(f"{server}/v1/responses", json={"model": "qwen3", "input": "Hi", "stream": True})
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_tool_call_after_thinking_is_a_call(server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    r = client.chat.completions.create(model="qwen3", messages=ASK, tools=tools)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "get_time"


def test_a_model_without_thinking_answers_without_blocks(agent_server):
    """The bundled SmolLM2 has no thinking format: thinking requests are served, with no thinking blocks."""
    url, _ = agent_server
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
    model = chat.models.list().data[0].id
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY)
    message = client.messages.create(model=model, max_tokens=8, messages=ASK, thinking={"type": "enabled",
                                                                                          "budget_tokens": 1024})
    assert message.content and all(b.type != "thinking" for b in message.content)
    r = chat.chat.completions.create(model=model, messages=ASK, max_tokens=8, reasoning_effort="high")
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
