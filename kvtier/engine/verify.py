"""The target's choice at one row of a verify step, given the token the draft proposed there.

Greedy rows take the argmax: the proposal stands only if it is that token, so greedy output is the same with and
without speculation. Sampled rows use rejection sampling against a draft that proposes one token with certainty (a
point mass q = δ_d, as prompt lookup does): d is accepted with probability p(d); otherwise a token is drawn from the
residual max(p - q, 0), which is p with d left out. Every token then follows p exactly (Leviathan et al. 2023,
Chen et al. 2023). Draws use the sequence's seeded generator, on the CPU, where it has one.
"""
from __future__ import annotations

import torch

from kvtier.engine.sampler import probabilities
from kvtier.engine.sampling_params import SamplingParams


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           proposed: int | None) -> int:
    """The token at a row of processed logits [vocab]; proposed: the draft's token there (None past the draft)."""
    if params.greedy:
        return int(logits.argmax())
    probs = probabilities(logits[None], [params])[0].cpu()
    if proposed is not None:
        if float(torch.rand((), generator=generator)) < float(probs[proposed]):
            return proposed
        probs[proposed] = 0.0     # rejected: p(d) < 1, so the rest has mass
    return int(torch.multinomial(probs, 1, generator=generator))
