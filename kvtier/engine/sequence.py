"""One request's state inside the engine."""
from __future__ import annotations

import enum

import torch

from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.outputs import TokenLogprob
from kvtier.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"     # its prefix is being copied up from a lower tier
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, arrival: int, root_key: bytes | None = None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.arrival = arrival                  # admission order; the newest is preempted first
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []       # content keys of the sealed (full, computed) blocks
        self.root_key = root_key                # the first block's parent: a cache salt's, or None
        self.num_computed_tokens = 0            # tokens whose K/V are in the pool
        self.num_cached_tokens = 0              # prompt tokens served from the prefix cache
        self.tier_tokens: dict[str, int] = {}   # of those, how many came from which tier
        self.residency = None                   # the pager's state under bounded residency, else None
        self.constraint = None                  # its grammar's state (engine/grammar.py), if it has one
        self.finish_reason: str | None = None
        self.error: str | None = None           # why the engine failed it (finish_reason "error")
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # what the next RequestOutput reports, reset each time one is emitted
        self.pending_token_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
