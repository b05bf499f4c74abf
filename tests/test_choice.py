"""Kernels chosen by measurement (choice.py): the fastest of the candidates that give the first one's result; one
that disagrees or fails is never chosen, however fast. On CPU with torch's own products as the candidates."""
import math

import torch
import torch.nn.functional as F

from kvtier.models.choice import fastest

IN = 256


def test_the_fastest_candidate_that_agrees_is_chosen():
    weights = [torch.randn(512, IN, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def slow(w, x):          # the same product, computed twenty times over
        for _ in range(19):
            F.linear(x, w)
        return F.linear(x, w)

    def fails(w, x):
        raise RuntimeError("no kernel for this device")

    candidates = {"reference": slow, "linear": lambda w, x: F.linear(x, w), "fails": fails,
                  "wrong": lambda w, x: 1.5 * F.linear(x, w)[:, :1], "off": lambda w, x: 1.1 * F.linear(x, w)}
    chosen, seconds = fastest(candidates, weights, IN, (1, 16), torch.float32, torch.device("cpu"))
    assert chosen == "linear" and set(seconds) == set(candidates)
    assert seconds["linear"] < seconds["reference"] < math.inf
    assert seconds["fails"] == seconds["wrong"] == seconds["off"] == math.inf


def test_the_first_candidate_stays_when_no_other_agrees():
    weights = [torch.randn(64, IN)]
    chosen, seconds = fastest({"reference": lambda w, x: F.linear(x, w), "zeros": lambda w, x: torch.zeros(1)},
                              weights, IN, (1,), torch.float32, torch.device("cpu"))
    assert chosen == "reference" and seconds["zeros"] == math.inf
