"""Tool-call parsers: whole and streamed (split at every character), malformed calls stay content."""
import json

import pytest

from kvtier.server.tool_parsers import PARSERS, parser_for_template
from kvtier.server.tools import hermes_call, template_messages

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name":"convert","arguments":"{\\"celsius\\": 21}"}</tool_call>\n')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Lyon; France"}}; {"name": "convert", "parameters": {}}'


def streamed(parser, text: str, cut: int):
    streamer = parser.streamer()
    first, second = streamer.feed(text[:cut]), streamer.feed(text[cut:], final=True)
    return first[0] + second[0], first[1] + second[1]


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", HERMES, "Let me look.\n", [("get_weather", {"city": "Paris"}), ("convert", {"celsius": 21})]),
    ("llama3_json", LLAMA, "", [("get_weather", {"city": "Lyon; France"}), ("convert", {})]),
])
def test_whole_and_streamed_at_every_split_agree(name, text, content, calls):
    parser = PARSERS[name]
    whole = parser.parse(text)
    assert whole[0] == content and [(c.name, json.loads(c.arguments)) for c in whole[1]] == calls
    for cut in range(len(text) + 1):
        got_content, got_calls = streamed(parser, text, cut)
        assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, cut
        assert "<tool_call>" not in got_content


@pytest.mark.parametrize("name, text", [
    ("hermes", 'Sure. <tool_call>{"name": broken json}</tool_call> done'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),                 # no name
    ("hermes", 'cut off: <tool_call>{"name": "f", "argu'),                  # max_tokens inside a call
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),                  # arguments not an object
    ("llama3_json", 'Plain prose that mentions {"name": "f"}'),
])
def test_malformed_calls_are_plain_content(name, text):
    parser = PARSERS[name]
    assert parser.parse(text) == (text, [])
    for cut in range(len(text) + 1):
        assert streamed(parser, text, cut) == (text, [])


def test_the_parser_follows_the_template():
    assert parser_for_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for_template("<|im_start|>{{ message['content'] }}").name == "hermes"
    assert parser_for_template(None).name == "hermes"


def test_generic_rendering_writes_tools_calls_and_results_in_hermes_form():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "sunny"}]
    rendered, template_tools = template_messages(messages, tools, template_knows_tools=False)
    assert template_tools is None
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": hermes_call("get_weather", {"city": "Paris"})}
    assert rendered[3] == {"role": "user",
                           "content": "<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"}
    assert PARSERS["hermes"].parse(rendered[2]["content"])[1][0].name == "get_weather"    # it reads back
    native, native_tools = template_messages(messages, tools, template_knows_tools=True)
    assert native_tools == tools and native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
