"""One request's state inside the engine."""
from __future__ import annotations

import enum

import torch

from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.outputs import TokenLogprob
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.state import KVState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, arrival: int):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.arrival = arrival                  # arrival order, kept through preemption; the newest is preempted first
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0            # tokens whose K/V are in the pool
        self.kv: KVState | None = None          # its KV state, owned by the KV manager
        self.constraint = None                  # its grammar's state (engine/grammar.py), if it has one
        self.finish_reason: str | None = None
        self.error: str | None = None           # why the engine failed it (finish_reason "error")
        self.draft: list[int] = []              # tokens proposed for its next step, not yet verified
        self.spec = None                        # its speculation state (spec/speculator.py), when the server speculates
        self.drafter_loading = False            # its drafter's cached prefix is loading: not admitted yet
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # what the next RequestOutput reports, reset each time one is emitted
        self.pending_token_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def step_tokens(self, start: int, n: int) -> list[int]:
        """The n tokens a step feeds from position start: its own, then its draft's (whose first token stands at
        position len(token_ids))."""
        tokens = self.token_ids[start:start + n]
        first = max(0, start - len(self.token_ids))
        return tokens + self.draft[first:first + n - len(tokens)]

    def num_drafted(self, n: int) -> int:
        """How many of a step's n tokens (from the first uncomputed one) are draft tokens: a verify step's."""
        return max(0, self.num_computed_tokens + n - len(self.token_ids))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
