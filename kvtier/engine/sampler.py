"""Next-token choice: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""
from __future__ import annotations

import torch

from kvtier.engine.outputs import TokenLogprob
from kvtier.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of float32 logits [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.cpu() / params.temperature   # sampled on the CPU so seeded generators work on any device
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the tokens before it already reach top_p (the best one always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """Log-probability of the chosen token under the model's raw distribution, plus the top_n."""
    logprobs = logits.log_softmax(-1)
    top = torch.topk(logprobs, top_n) if top_n else None
    return TokenLogprob(
        token_id=token_id,
        logprob=float(logprobs[token_id]),
        top=[] if top is None else list(zip(top.indices.tolist(), top.values.tolist())),
    )
