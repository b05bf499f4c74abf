"""The engine against transformers on the bundled model (float32, CPU)."""

import pytest
import torch

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.scheduler import ScheduledBatch
from kvtier.engine.sequence import Sequence

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why they are prime.",
]


@pytest.fixture(scope="module")
def reference(bundled_transformers):
    return bundled_transformers


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(Config(kv_pool_tokens=16384, max_batched_tokens=512, quantize="none"))


def generate(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def text_prompt(engine, num_tokens: int) -> list[int]:
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog near river {i}." for i in range(400))
    return engine.tokenizer.encode(text)[:num_tokens]


@pytest.mark.parametrize("num_tokens", [5, 64, 130, 700])
def test_prefill_logits_match_transformers(engine, reference, num_tokens):
    ids = text_prompt(engine, num_tokens)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    seq = Sequence("logits", ids, SamplingParams(), None, arrival=0)
    seq.kv = engine.kv.new_state("logits", seq.token_ids, len(ids), None)
    assert engine.kv.reserve(seq.kv, len(ids))
    try:
        # two chunks when long enough, so the offset causal mask over cached slots is covered too
        first = len(ids) // 2 if len(ids) > 64 else len(ids)
        batch = ScheduledBatch()
        batch.add(seq, first)
        logits, _ = engine.runner.run(batch)
        if first < len(ids):
            seq.num_computed_tokens = first
            batch = ScheduledBatch()
            batch.add(seq, len(ids) - first)
            logits, _ = engine.runner.run(batch)
    finally:
        engine.kv.release(seq.kv)
    assert (logits[0][-1].cpu() - expected).abs().max().item() < 1e-3


def test_greedy_generation_matches_transformers(engine, reference):
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = generate(engine, prompts, SamplingParams(max_tokens=32, temperature=0.0))
    for ids, got in zip(prompts, ours):
        out = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        expected = out[0, len(ids):].tolist()
        assert got == expected, engine.tokenizer.decode(got)


def test_concurrent_requests_match_solo_runs(engine):
    prompts = [text_prompt(engine, n) for n in (3, 17, 64, 65, 128, 200, 333, 600)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = [generate(engine, [p], params)[0] for p in prompts]
    together = generate(engine, prompts, params)
    assert together == solo
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
