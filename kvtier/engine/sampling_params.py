"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5         # a temperature below this is greedy (as in vLLM): dividing by it overflows
MIN_TOP_P = 1e-6            # top_p is clamped up to this: smaller values underflow in float32 to 0
MAX_STOP_CHARS = 256        # the detokenizer holds back this much text while a stop string may begin


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0      # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 → disabled
    seed: int | None = None       # same seed, same output
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None   # None → no logprobs; N → chosen token plus top-N alternatives
    presence_penalty: float = 0.0     # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0    # OpenAI's: subtracted per time a token was generated
    repetition_penalty: float = 1.0   # vLLM's: a seen token's logit is divided by it (multiplied, if negative)
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id → added to its logit
    min_tokens: int = 0               # end-of-sequence tokens are masked until this many are generated
    grammar: str | None = None        # a Lark grammar (llguidance) the output must follow

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValueError("stop must hold at most 4 non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -100.0 <= bias <= 100.0 for bias in self.logit_bias.values()) or \
                any(token < 0 for token in self.logit_bias):
            raise ValueError("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
        # normalise values that are legal but would overflow the sampler's float32 arithmetic
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        self.top_p = max(self.top_p, MIN_TOP_P)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: the same, with its own seed (the seed + index, wrapped)."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index + 2**63) % 2**64 - 2**63)

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling (else they are sampled as they are)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
