"""OpenAI-compatible request and response schemas, and how engine outputs become responses.

Nothing is silently ignored: an unknown request field, or one kvtier cannot honour, is a 400
that names it.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampling_params import SamplingParams


def find_unencodable(value, path: str = "") -> str | None:
    """The path of the first string in a JSON value that UTF-8 cannot encode (a lone surrogate), else None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        return next(filter(None, (find_unencodable(v, f"{path}.{k}" if path else str(k)) for k, v in value.items())),
                    None)
    elif isinstance(value, list | tuple):
        return next(filter(None, (find_unencodable(v, f"{path}[{i}]") for i, v in enumerate(value))), None)
    return None


def text_chars(value) -> int:
    """How many characters of text a JSON value holds (a bound on what it adds to a prompt)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", reason: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        # what the log and /metrics call it: a word from a small fixed set, never text from the request
        self.reason = reason or code or type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- requests

MAX_CHOICES = 16        # n


class RequestModel(BaseModel, extra="forbid"):
    """A request body: a field kvtier does not know is a 400 naming it, never silently dropped."""


class StreamOptions(RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None   # a hint: nothing is padded


class ChatMessage(BaseModel, extra="allow"):   # extra keys (name, tool_calls, ...) reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content):
        # OpenAI also allows a list of parts; a text model can only take the text ones
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError("only text content parts ({'type': 'text', 'text': '...'}) are supported")
            return "\n".join(p["text"] for p in content)
        return content

    def for_template(self) -> dict:
        message = {**self.model_dump(exclude_none=True), "content": self.content or ""}
        if self.role == "developer":    # OpenAI's newer name for the system role; templates know "system"
            message["role"] = "system"
        return message


class KvtierOptions(RequestModel):
    """The `kvtier` request extension (pass it with the openai client's extra_body)."""
    pin: list[tuple[int, int]] = []   # half-open prompt token ranges kept resident under bounded residency


class _GenerationRequest(RequestModel):
    """Every optional field also takes an explicit null, as OpenAI's specification allows."""
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None              # extension; -1 means "off" as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)     # checked before any choice is set up
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None   # extension, as in vLLM
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None             # extension, as in vLLM
    user: str | None = None                   # an end-user id for the caller's records: accepted, not used
    kvtier: KvtierOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)   # as in vLLM: shares KV only with the same salt

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                        grammar: str | None = None) -> SamplingParams:
        """Validated engine parameters; APIError(400) for anything out of range or unsupported.
        grammar: what the output must follow (a forced tool call, a JSON schema)."""
        self._check_supported()
        room = max_model_len - num_prompt_tokens
        max_tokens = self._max_tokens()
        # at least 1, so that a prompt filling the whole context gets the engine's clear rejection; more than the
        # context has room for is capped to it, as llama.cpp does (agents ask for 32K-64K whatever the model)
        if max_tokens is None:
            max_tokens = max(1, self._default_max_tokens(room))
        elif max_tokens > 1:
            max_tokens = max(1, min(max_tokens, room))
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                seed=self.seed,
                stop=self.stop or [],
                logprobs=self._logprobs(),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self._logit_bias(),
                min_tokens=self.min_tokens or 0,
                grammar=grammar,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _logit_bias(self) -> dict[int, float]:
        try:    # JSON object keys are strings: OpenAI sends token ids as "1234"
            return {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None

    def _check_supported(self) -> None:
        """Fields that are valid alone but not honoured in this combination: 400s (see the subclasses)."""

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _default_max_tokens(self, remaining: int) -> int:
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        raise NotImplementedError


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None     # a JSON schema
    strict: bool | None = None         # calls always match the schema when a call is forced


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(RequestModel, populate_by_name=True):
    name: str
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel, populate_by_name=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")    # llama.cpp's extension: the schema beside the type


# what kvtier itself hands the chat template (or the call that renders it)
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                                "documents", "continue_final_message", "return_dict", "chat_template", "tokenizer"})


class OpenAIHints(RequestModel):
    """Hints both OpenAI APIs take: accepted and not used (see the README's table of request fields)."""
    service_tier: str | None = None
    prompt_cache_key: str | None = None       # kvtier caches every prefix by content anyway
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


class ChatCompletionRequest(_GenerationRequest, OpenAIHints):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None         # legacy form of tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None   # legacy form of tool_choice
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None       # "none" switches a reasoning model's thinking off, others on
    chat_template_kwargs: dict | None = None  # as in vLLM: more variables for the chat template
    # hints and metadata, accepted and not used (see the README's table of request fields)
    store: bool | None = None
    metadata: dict | None = None
    verbosity: str | None = None
    modalities: list[Literal["text"]] | None = None

    def template_kwargs(self) -> dict:
        """The chat template's extra variables; reasoning_effort sets its thinking switch unless they do."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(kwargs.keys() & TEMPLATE_VARIABLES)
        if taken:
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(taken)}", param="chat_template_kwargs")
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @property
    def legacy_functions(self) -> bool:
        return self.functions is not None

    def functions_offered(self) -> list[dict]:
        """The functions the model may call (from tools or the legacy functions), as plain JSON."""
        if self.tools and self.functions:
            raise APIError(400, "send tools or the legacy functions, not both", param="functions")
        functions = [t.function for t in self.tools or []] + list(self.functions or [])
        return [f.model_dump(exclude_none=True) for f in functions]

    def tool_mode(self) -> str | None:
        """None (no tools), "none", "auto", "required", or the name of the one function to call."""
        offered = {f["name"] for f in self.functions_offered()}
        choice = self.tool_choice if not self.legacy_functions else self.function_call
        param = "function_call" if self.legacy_functions else "tool_choice"
        if not offered:
            if choice not in (None, "none"):
                raise APIError(400, f"{param} needs tools to choose from", param=param)
            return None
        if isinstance(choice, NamedToolChoice | NamedFunction):
            name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
            if name not in offered:
                raise APIError(400, f"{param} names '{name}', which is not among the tools", param=param)
            return name
        return choice or "auto"

    def output_schema(self) -> dict | None:
        """The JSON schema response_format asks the reply to match, or None."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.schema_ is not None:
            return fmt.schema_
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        return fmt.json_schema.json_schema

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _default_max_tokens(self, remaining: int) -> int:
        return remaining   # the rest of the context, as vLLM does

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        # OpenAI also takes a batch (a list of strings or of token-id lists); we take a batch of one
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
            return prompt[0]
        return prompt

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (it needs the prompt's logprobs)", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, f"only best_of=1 is supported, got best_of={self.best_of}", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def _default_max_tokens(self, remaining: int) -> int:
        return min(16, remaining)   # OpenAI's default for completions

    def _logprobs(self) -> int | None:
        return self.logprobs


# ---------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, out: RequestOutput) -> Usage:
        return cls(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                   total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


OMITTED_UNLESS_SET = Field(None, exclude_if=lambda value: value is None)   # as OpenAI leaves such keys out


class FunctionCall(BaseModel):
    name: str
    arguments: str                     # a JSON object


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = OMITTED_UNLESS_SET     # a reasoning model's thoughts, as vLLM names them
    tool_calls: list[ToolCallOut] | None = OMITTED_UNLESS_SET
    function_call: FunctionCall | None = OMITTED_UNLESS_SET    # the legacy `functions` API


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = OMITTED_UNLESS_SET
    tool_calls: list[ToolCallDelta] | None = OMITTED_UNLESS_SET
    function_call: FunctionCallDelta | None = OMITTED_UNLESS_SET


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):   # also the shape of each streamed chunk (usage only at the end)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
