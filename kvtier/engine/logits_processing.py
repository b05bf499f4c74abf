"""What a request's parameters do to its logits before sampling: logit_bias, min_tokens, and the
presence, frequency and repetition penalties. A request that sets none of them pays nothing."""
from __future__ import annotations

import torch

from kvtier.engine.sampling_params import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
                   eos_token_ids: frozenset[int]) -> torch.Tensor:
    """One sequence's next-token logits [vocab] after its parameters (a new tensor where they change any; `logits`
    itself is never changed)."""
    if not params.adjusts_logits:
        return logits
    logits = logits.clone()
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=device)
    output = token_ids[num_prompt_tokens:]
    if len(output) < params.min_tokens and eos_token_ids and not params.ignore_eos:
        logits[torch.tensor(sorted(eos_token_ids), device=device)] = float("-inf")
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=device), minlength=logits.numel())
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    return logits
