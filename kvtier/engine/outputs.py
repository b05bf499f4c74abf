"""What the engine hands back to its callers after each step."""
from __future__ import annotations

from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """The request can never be served (too long for the model or the pool, bad input)."""


class RequestFailed(RuntimeError):
    """The engine failed while serving this request; the other requests go on."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]          # tokens produced since the previous output
    new_text: str                     # text delta since the previous output (stop strings cut)
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None         # "stop" | "length" | "abort" | "error" while finished, else None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None          # with finish_reason "error": what went wrong
    stop_string: str | None = None    # with finish_reason "stop": the stop string that ended it, if one did
