"""logit_bias, min_tokens and the presence, frequency and repetition penalties on a request's logits."""
import pytest
import torch

from kvtier.engine.logits_processing import process_logits
from kvtier.engine.sampling_params import SamplingParams

EOS = frozenset({2})


def logits():
    return torch.tensor([1.0, -1.0, 3.0, 0.5, 2.0])


def test_nothing_set_costs_nothing():
    raw = logits()
    assert process_logits(raw, SamplingParams(), [0, 1], 1, EOS) is raw


def test_logit_bias_adds_to_its_tokens():
    out = process_logits(logits(), SamplingParams(logit_bias={1: 100.0, 4: -100.0}), [0], 1, EOS)
    assert int(out.argmax()) == 1 and out[4] == -98.0 and out[0] == 1.0


def test_min_tokens_masks_eos_until_reached():
    params = SamplingParams(max_tokens=5, min_tokens=2)
    assert process_logits(logits(), params, [0, 3], 1, EOS)[2] == float("-inf")      # 1 output token so far
    assert process_logits(logits(), params, [0, 3, 4], 1, EOS)[2] == 3.0            # 2: EOS allowed again


def test_presence_and_frequency_penalties_count_output_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits(), params, [4, 4, 0, 0, 0], 2, EOS)     # prompt [4, 4], output [0, 0, 0]
    assert out[0] == pytest.approx(1.0 - 0.5 - 3 * 0.25) and out[4] == 2.0


def test_repetition_penalty_shrinks_seen_tokens_toward_less_likely():
    out = process_logits(logits(), SamplingParams(repetition_penalty=2.0), [2, 1], 1, EOS)
    assert out[2] == 1.5 and out[1] == -2.0 and out[4] == 2.0


def test_penalties_change_what_greedy_picks():
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    out = process_logits(logits(), params, [9, 2, 2], 1, EOS)
    assert int(out.argmax()) == 4
