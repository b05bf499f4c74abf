"""The target's choice at one row of a verify step, given the token the draft proposed there.

Greedy rows take the argmax: the proposal stands only if it is that token, so greedy output is the same with and
without speculation. Sampled rows draw one token x from the target's distribution p, as a decode step would, and
the proposal d stands only if x = d. For a draft that proposes one token with certainty (a point mass q = δ_d, as
prompt lookup does) this is rejection sampling itself: d is kept with probability p(d) = min(1, p(d)/q(d)), and
otherwise x follows p without d, the residual max(p - q, 0) normalized (Leviathan et al. 2023, Chen et al. 2023).
Drawing x first also consumes a seeded generator exactly as decoding does: a seed gives the same text with and
without speculation.
"""
from __future__ import annotations

import torch

from kvtier.engine.sampler import argmax, draw, probabilities
from kvtier.engine.sampling_params import SamplingParams


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's token at a row of processed logits [vocab]: the argmax, or one draw, on the CPU with the
    sequence's generator where it has one (as the sampler draws seeded rows)."""
    if params.greedy:
        return int(argmax(logits))
    probs = probabilities(logits[None], [params])[0]
    if generator is not None:
        probs = probs.cpu()
    return int(draw(probs[None], generator))
