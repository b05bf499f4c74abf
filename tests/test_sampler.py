"""Batched sampling gives, row by row, the tokens the one-row sampler gave before it (the reference below, as it
was): same seeds, same tokens; logprobs the same too."""
import pytest
import torch

from kvtier.engine.sampler import argmax, sample, token_logprobs
from kvtier.engine.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference_sample(logits, params, generator):
    if params.greedy:
        return int(logits.argmax())
    logits = logits.cpu() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


PARAMS = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=1.3, top_k=5, seed=2),
          dict(temperature=0.7, top_p=0.9, seed=3), dict(temperature=1.0, top_k=40, top_p=0.5, seed=4),
          dict(temperature=0.0, top_k=3), dict(temperature=2.0, top_k=1, seed=5), dict(temperature=1.0, seed=6)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_samples_what_each_row_sampled_alone(device):
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(**p) for p in PARAMS]
    for step in range(20):
        logits = torch.randn(len(params), 500, generator=gen) * 3
        batch = sample(logits.to(device), params, [torch.Generator().manual_seed(step * 100 + i) if p.seed is not None
                                                   else None for i, p in enumerate(params)])
        alone = [reference_sample(row, p, torch.Generator().manual_seed(step * 100 + i) if p.seed is not None
                                  else None) for i, (row, p) in enumerate(zip(logits, params))]
        assert batch == alone


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_draw_from_their_own_distribution(device):
    """Rows without a seed share one draw on the device: each still samples only what its top-k allows."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).to(device)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 2, 3, 4)]
    allowed = [set(torch.topk(row, k).indices.tolist()) for row, k in zip(logits.cpu(), (1, 2, 3, 4))]
    for _ in range(50):
        tokens = sample(logits, params, [None] * 4)
        assert all(t in a for t, a in zip(tokens, allowed))


def test_logprobs_of_a_batch_are_each_rows():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    out = token_logprobs(logits, [5, 17, 199], [0, 3, 1])
    for row, lp, token, n in zip(logits, out, [5, 17, 199], [0, 3, 1]):
        logprobs = row.log_softmax(-1)
        top = torch.topk(logprobs, n) if n else None
        assert lp.token_id == token and lp.logprob == pytest.approx(float(logprobs[token]), abs=1e-6)
        assert [i for i, _ in lp.top] == ([] if top is None else top.indices.tolist())


def test_argmax_picks_what_torchs_picks():
    """Ties (the first wins), NaN (counts as highest), rows all -inf (masked by a grammar), a single row [vocab]."""
    torch.manual_seed(0)
    rows = torch.randint(-3, 3, (64, 300)).float()         # many ties
    rows[1, 7] = float("nan")
    rows[2] = float("-inf")
    rows[3, :] = float("-inf")
    rows[3, 299] = 0.0
    for logits in (rows, rows[5], rows[:, ::2], torch.randn(3, 49152)):
        assert torch.equal(argmax(logits), logits.argmax(-1))
