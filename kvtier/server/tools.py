"""Tools and structured output in a chat request: how tools reach the prompt, and the grammars that force
a call or a JSON reply (Lark with embedded JSON schemas, compiled by llguidance in the engine)."""
from __future__ import annotations

import json
import re

import llguidance

# For chat templates that have no tool format of their own: the tools go into the system message, and
# calls and results are written in the Hermes form the `hermes` parser reads back.
TOOLS_SYSTEM_PROMPT = """# Tools

You can call functions to help with the request. They are described in JSON inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, reply with a <tool_call></tool_call> block for each call, holding a JSON object with \
the function's name and its arguments:
<tool_call>
{{"name":<function name>,"arguments":<the arguments as a JSON object>}}
</tool_call>"""
HERMES_START, HERMES_END = "<tool_call>\n", "\n</tool_call>"
COMPACT = {"x-guidance": {"whitespace_flexible": False}}   # forced JSON is written without free whitespace


def template_messages(messages: list[dict], tools: list[dict] | None,
                      template_knows_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools as the chat template takes them. A template with a tool format of its own
    gets both as they are (call arguments as objects, as templates expect); for one without, the tools
    are described in the system message and calls and results are written out in Hermes form."""
    messages = [_arguments_as_objects(m) for m in messages]
    if template_knows_tools:
        return messages, tools
    rendered: list[dict] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            message = {"role": "assistant", "content": "\n".join(filter(None, (message.get("content"), calls)))}
        elif message["role"] == "tool":
            result = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if rendered and rendered[-1].get("tool_results"):      # results of one turn share a message
                rendered[-1]["content"] += "\n" + result
                continue
            message = {"role": "user", "content": result, "tool_results": True}
        rendered.append(message)
    rendered = [{k: v for k, v in m.items() if k != "tool_results"} for m in rendered]
    if tools:
        described = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{described}"}
        else:
            rendered.insert(0, {"role": "system", "content": described})
    return rendered, None


def hermes_call(name: str, arguments) -> str:
    """A call as a forced call is generated (compact JSON), so a history that repeats it reuses its KV."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))
    return f"{HERMES_START}{call}{HERMES_END}"


def _arguments_as_objects(message: dict) -> dict:
    """OpenAI sends call arguments as JSON strings; chat templates write them out as objects."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call.get("function", {}).get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass     # left as the string the client sent
        calls.append({**call, "function": {**call.get("function", {}), "arguments": arguments}})
    return {**message, "tool_calls": calls}


def lark_text(text: str, tokens: frozenset[str]) -> str:
    """Text as a Lark sequence. Where it holds one of the tokenizer's added tokens (`<think>`, `<tool_call>`),
    the token is named as a token: llguidance lets such a token through its mask for the literal text, then
    refuses it."""
    names = sorted((t for t in tokens if len(t) > 2 and t[0] == "<" and t[-1] == ">" and t in text), key=len,
                   reverse=True)
    if not names:
        return json.dumps(text)
    pieces = re.split(f"({'|'.join(map(re.escape, names))})", text)
    return " ".join(piece if piece in names else json.dumps(piece) for piece in pieces if piece)


def tool_call_grammar(functions: list[dict], parser: str, parallel: bool, tokens: frozenset[str]) -> str:
    """A grammar whose every sentence is a call (one or more with parallel calls) of one of `functions`,
    written as `parser` reads it, with arguments matching the function's parameter schema; tokens: the
    tokenizer's added tokens."""
    arguments_key = "parameters" if parser == "llama3_json" else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
              "properties": {"name": {"const": f["name"]},
                             arguments_key: f.get("parameters") or {"type": "object"}}} for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **COMPACT}
    if parser == "llama3_json":
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: %json {json.dumps(schema)}"
    more = "+" if parallel else ""
    return f"start: call{more}\ncall: {lark_text(HERMES_START, tokens)} %json {json.dumps(schema)} " \
        f"{lark_text(HERMES_END, tokens)}"


def json_grammar(schema: dict) -> str:
    """A grammar whose every sentence is a JSON value matching schema."""
    return f"start: %json {json.dumps({**schema, **COMPACT})}"


def grammar_error(grammar: str) -> str | None:
    """Why llguidance cannot compile the grammar (an invalid schema, say), or None."""
    try:
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) or None
    except Exception as e:    # the compiler raises on malformed input rather than reporting it
        return str(e)
