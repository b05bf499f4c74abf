"""Tool definitions as agents send them, sorted into the functions a model can call.

- Functions are offered as they are. A freeform ("custom") tool, whose input is plain text, is offered as a
  function of one string argument, `input`, and its calls are answered as custom tool calls.
- Grouped or namespaced tools (a definition with tools of its own) become the functions they contain.
- Hosted tools, which the server itself would have to run (web search, file search, computer use, code
  execution, MCP connectors), are left out of the prompt: the model cannot call them, and the route logs them.
- Anything else is a 400 that names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from kvtier.server.protocol import APIError, FunctionDefinition

# OpenAI's hosted tools, and the items their calls leave in a conversation (left out of the prompt)
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                          "computer_use_preview", "computer_use", "code_interpreter", "image_generation", "mcp",
                          "local_shell", "tool_search", "web_search_2025_08_26"})
HOSTED_CALLS = frozenset({"web_search_call", "file_search_call", "computer_call", "computer_call_output",
                          "code_interpreter_call", "image_generation_call", "mcp_call", "mcp_list_tools",
                          "mcp_approval_request", "mcp_approval_response", "local_shell_call",
                          "local_shell_call_output", "tool_search_call", "tool_search_output"})
# Anthropic's server tools and its schema-less client tools are named by a versioned type, e.g. web_search_20250305
ANTHROPIC_HOSTED_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "computer_", "bash_", "text_editor_",
                             "memory_", "tool_search_tool_", "mcp_toolset")
FREEFORM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                       "additionalProperties": False}


@dataclass
class FunctionSet:
    functions: list[dict] = field(default_factory=list)   # {name, description?, parameters?, strict?}
    freeform: set[str] = field(default_factory=set)       # names of the functions that stand for custom tools
    hosted: list[str] = field(default_factory=list)       # the types of the tools left out


def responses_functions(tools: list[dict], where: str = "tools") -> FunctionSet:
    """The Responses API's (or chat completions') tool definitions, sorted."""
    found = FunctionSet()
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        here = f"{where}[{i}]"
        if isinstance(tool, dict) and isinstance(tool.get("tools"), list):     # a namespace or group
            inner = responses_functions(tool["tools"], f"{here}.tools")
            found.functions += inner.functions
            found.freeform |= inner.freeform
            found.hosted += inner.hosted
        elif kind == "function":
            # chat completions nest the definition under "function"; the Responses API does not
            found.functions.append(_function(tool.get("function", tool), here))
        elif kind == "custom":
            definition = tool.get("custom", tool)
            found.functions.append(_function({"name": definition.get("name"), "parameters": FREEFORM_PARAMETERS,
                                              "description": _freeform_description(definition)}, here))
            found.freeform.add(definition.get("name"))
        elif kind in HOSTED_TOOLS:
            found.hosted.append(kind)
        else:
            raise APIError(400, f"{here}: tools of type '{kind}' are not supported", param="tools")
    return found


def anthropic_functions(tools: list[dict]) -> FunctionSet:
    """Anthropic's tool definitions, sorted: custom tools (no type, or "custom") are functions."""
    found = FunctionSet()
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind in (None, "custom"):
            if not isinstance(tool.get("input_schema"), dict):
                raise APIError(400, f"tools[{i}].input_schema: a JSON schema object is required", param="tools")
            found.functions.append(_function({"name": tool.get("name"), "description": tool.get("description"),
                                              "parameters": tool["input_schema"]}, f"tools[{i}]"))
        elif isinstance(kind, str) and kind.startswith(ANTHROPIC_HOSTED_PREFIXES):
            found.hosted.append(kind)
        else:
            raise APIError(400, f"tools[{i}]: tools of type '{kind}' are not supported", param="tools")
    return found


def _function(definition: dict, where: str) -> dict:
    keys = ("name", "description", "parameters", "strict")
    try:
        function = FunctionDefinition(**{k: definition.get(k) for k in keys if definition.get(k) is not None})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise APIError(400, f"{where}: {problems}", param="tools") from None
    return function.model_dump(exclude_none=True)


def _freeform_description(tool: dict) -> str:
    """A custom tool's description, with the grammar its input follows when it gives one."""
    description = tool.get("description") or ""
    fmt = tool.get("format") or {}
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        description += f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return description.strip()
