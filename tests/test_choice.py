"""Kernels chosen by measurement (choice.py): the fastest of the candidates that give the first one's result, by a
clear margin; one that disagrees or fails is never chosen, however fast. On CPU with torch's own products as the
candidates, their times set by the test (on CUDA they are CUDA graphs' replays, checked by test_int4pack.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

from kvtier.models import choice
from kvtier.models.choice import fastest

IN = 256
WEIGHTS = [torch.randn(512, IN, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def reference(w, x):
    return F.linear(x, w)


def linear(w, x):
    return F.linear(x.contiguous(), w)


def fails(w, x):
    raise RuntimeError("no kernel for this device")


def narrow(w, x):
    return F.linear(x, w)[:, :1]


def off(w, x):
    return 1.1 * F.linear(x, w)


@pytest.fixture
def times(monkeypatch):
    """Each candidate's seconds per product, as the test sets them."""
    seconds = {}
    monkeypatch.setattr(choice, "_seconds_per_product", lambda product, weights, x: seconds[product])
    return seconds


def test_the_fastest_candidate_that_agrees_is_chosen(times):
    times.update({reference: 3.0, linear: 1.0, fails: 0.1, narrow: 0.1, off: 0.1})
    candidates = {f.__name__: f for f in (reference, linear, fails, narrow, off)}
    chosen, seconds = fastest(candidates, WEIGHTS, IN, (1, 16), torch.float32, torch.device("cpu"))
    assert chosen == "linear" and seconds["linear"] == 2.0 and seconds["reference"] == 6.0
    assert seconds["fails"] == seconds["narrow"] == seconds["off"] == math.inf


def test_a_near_tie_keeps_the_first(times):
    times.update({reference: 1.0, linear: 0.95})
    chosen, seconds = fastest({"reference": reference, "linear": linear}, WEIGHTS, IN, (1,), torch.float32,
                              torch.device("cpu"))
    assert chosen == "reference" and seconds == {"reference": 1.0, "linear": 0.95}


def test_on_cpu_a_product_is_timed_per_weight():
    seconds = choice._seconds_per_product(reference, WEIGHTS, torch.randn(4, IN))
    assert 0 < seconds < 1
