"""One request never harms another: bad sampling values are normalised, and a failure that belongs to
one request fails it alone while the others finish with the tokens they would have had alone."""
import pytest
import torch

from kvtier.config import Config
from kvtier.engine import engine as engine_module
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampler import sample
from kvtier.engine.sampling_params import SamplingParams

BS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=64 * BS, max_batched_tokens=64,
                            kv_host_gib=0))


def run_all(engine, requests):
    """requests: {id: (prompt, params)} → {id: final output with all tokens}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens, last = {rid: [] for rid in requests}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    return {rid: (tokens[rid], last[rid]) for rid in requests}


def innocent_requests():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return {f"r{i}": ([(11 * i + j) % 900 + 20 for j in range(10 + 9 * i)], params) for i in range(6)}


@pytest.mark.parametrize("temperature, top_p", [(1e-40, 1.0), (0.7, 1e-46), (1e-40, 1e-46)])
def test_extreme_sampling_values_are_normalised(temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p)
    logits = torch.randn(1000) * 10
    [token] = sample(logits[None], [params], [torch.Generator().manual_seed(0)])
    assert token == int(logits.argmax())    # each leaves only the best token


def test_a_too_long_stop_string_is_refused():
    with pytest.raises(ValueError, match="at most 256 characters"):
        SamplingParams(stop=["x" * 257])


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failing_request_fails_alone(engine, monkeypatch, where):
    alone = {rid: tokens for rid, (tokens, _) in run_all(engine, innocent_requests()).items()}
    if where == "forward":    # a forward that breaks whenever the poisoned request is in the batch
        real_run = engine.runner.run

        def run(batch, capture=None):
            if any(seq.request_id == "poison" for seq in batch.seqs):
                raise RuntimeError("kernel failure")
            return real_run(batch, capture)
        monkeypatch.setattr(engine.runner, "run", run)
    else:                     # a sampler that breaks on the poisoned request's parameters
        real_sample = engine_module.sample

        def poisoned_sample(logits, params, generators):
            if any(p.seed == 666 for p in params):
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
            return real_sample(logits, params, generators)
        monkeypatch.setattr(engine_module, "sample", poisoned_sample)
    requests = innocent_requests()
    requests["poison"] = ([5, 6, 7, 8, 9] * 7, SamplingParams(max_tokens=12, temperature=1.0, seed=666))
    results = run_all(engine, requests)
    tokens, out = results.pop("poison")
    assert out.finished and out.finish_reason == "error" and "RuntimeError" in out.error
    assert {rid: toks for rid, (toks, _) in results.items()} == alone
    assert all(o.finish_reason == "length" and o.error is None for _, o in results.values())
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
