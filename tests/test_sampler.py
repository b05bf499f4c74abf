"""Batched sampling gives, row by row, the tokens a plain one-row sampler (the reference below) gives: same seeds,
same tokens; logprobs the same too. Its draws follow the distribution they are given."""
import numpy as np
import pytest
import torch

from kvtier.engine.sampler import argmax, descending, draw, highest, sample, token_logprobs
from kvtier.engine.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference_sample(logits, params, generator):
    if params.greedy:
        return int(logits.argmax())
    logits = logits.cpu() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:     # the fewest best tokens whose probabilities reach top_p, and ties with the last
        sorted_logits = logits.sort(descending=True).values
        probs = sorted_logits.softmax(-1)
        kept = int((probs.cumsum(-1) - probs < params.top_p).sum())
        logits = logits.masked_fill(logits < sorted_logits[kept - 1], float("-inf"))
    # inverse CDF: the first token whose running sum passes a uniform draw
    cumulative = np.cumsum(logits.softmax(-1).double().numpy())
    u = float(torch.rand(1, dtype=torch.float64, generator=generator)) * cumulative[-1]
    return int(np.argmax(cumulative > u))


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


def test_draws_follow_their_distribution():
    """Frequencies of 40,000 seeded draws from rows with tiny and zero probabilities within a few standard errors;
    a zero-probability token never drawn; a row with nothing to draw from is an error."""
    p = torch.tensor([[0.5, 0.0, 0.25, 1e-3, 0.249, 0.0]])
    gen, draws = torch.Generator().manual_seed(7), 40_000
    counts = torch.bincount(torch.cat([draw(p, gen) for _ in range(draws)]), minlength=6).double()
    stderr = (p[0] * (1 - p[0]) / draws).sqrt()
    assert ((counts / draws - p[0]).abs() <= 5 * stderr + 1e-4).all() and counts[[1, 5]].sum() == 0
    with pytest.raises(ValueError, match="nothing to draw"):
        draw(torch.zeros(2, 4))


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


def test_highest_values_are_torchs():
    """The k highest values of each row from the highest, as torch's topk and sort give them, NaN and -inf too."""
    rows = torch.randint(-4, 4, (8, 301)).float()
    rows[0, 3], rows[1] = float("nan"), float("-inf")
    def same(a, b):
        return torch.equal(a.nan_to_num(nan=99.0), b.nan_to_num(nan=99.0))
    for k in (1, 40, 300, 301):
        assert same(highest(rows, k), torch.topk(rows, k).values)
    assert same(descending(rows), rows.sort(-1, descending=True).values)


def test_a_row_with_nothing_to_draw_from_uses_up_no_seed():
    """The batch fails before any draw: each request, sampled again alone, draws what it would have drawn."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    generator = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="nothing to draw"):
        sample(logits, params, [generator, torch.Generator().manual_seed(2)])
    assert sample(logits[:1], params[:1], [generator]) == sample(logits[:1], params[:1],
                                                                   [torch.Generator().manual_seed(1)])
