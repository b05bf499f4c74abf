"""Engine behaviour on a tiny random-weight model: batching, paging, preemption, sampling, aborts."""
import asyncio
import logging

import pytest
import torch
from conftest import run_greedy, tiny_llama, until_nothing_runs
from transformers import AutoModelForCausalLM

from kvtier.config import Config, ConfigError
from kvtier.engine.async_engine import AsyncEngine
from kvtier.engine.engine import LLMEngine
from kvtier.engine.outputs import RequestRejected
from kvtier.kv.pool import CPU_POOL_SHARE, cuda_pool_budget, default_pool_tokens
from kvtier.engine.sampling_params import SamplingParams

BS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=64 * BS, max_batched_tokens=64))


def run(engine, prompts, params):
    outs = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}", ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            o = outs.setdefault(out.request_id, {"tokens": [], "text": "", "logprobs": []})
            o["tokens"] += out.new_token_ids
            o["text"] += out.new_text
            o["logprobs"] += out.logprobs or []
            if out.finished:
                o["reason"], o["cached"] = out.finish_reason, out.num_cached_tokens
    return [outs[f"q{i}"] for i in range(len(prompts))]


def prompts(n, lengths=(5, 20, 33, 48, 64, 90, 7, 150)):
    return [[(7 * i + 3 * j) % 1000 + 10 for j in range(lengths[i % len(lengths)])] for i in range(n)]


def test_batched_and_chunked_equal_solo(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ps = prompts(8)
    solo = [run(engine, [p], params)[0]["tokens"] for p in ps]
    together = [o["tokens"] for o in run(engine, ps, params)]
    assert together == solo
    assert all(len(t) == 10 for t in solo)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_preemption_under_a_small_pool_changes_nothing(tiny_model_dir, engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ps = prompts(6, lengths=(50, 60, 70, 40, 55, 65))
    expected = [run(engine, [p], params)[0]["tokens"] for p in ps]
    small = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=12 * BS, max_batched_tokens=64))
    preempted = 0
    for i, p in enumerate(ps):
        small.add_request(f"q{i}", p, params)
    got = {f"q{i}": [] for i in range(len(ps))}
    while small.has_unfinished():
        # count preemptions by watching the queue refill with sequences that had started
        for out in small.step():
            got[out.request_id] += out.new_token_ids
        preempted += sum(1 for s in small.scheduler.waiting if s.num_output_tokens > 0)
    assert preempted > 0
    assert [got[f"q{i}"] for i in range(len(ps))] == expected
    assert small.pool.num_free_blocks == small.pool.num_blocks


def test_requests_that_can_never_fit_are_rejected(engine):
    with pytest.raises(RequestRejected, match="context length"):
        engine.add_request("long", [1] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestRejected, match="pool"):
        engine.add_request("big", [1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    assert not engine.has_unfinished()


def test_a_max_model_len_past_the_models_context_is_served_with_a_warning(make_tiny_model, bundled_tokenizer,
                                                                         caplog):
    """As llama.cpp's -c: --max-model-len past the model's context (64 here) is taken, not cut back to it without a
    word, the log says so, and positions past it rotate as transformers rotates them (RoPE's tables cover them)."""
    path = make_tiny_model(tiny_llama(bundled_tokenizer.vocab_size, context=64))
    with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
        long = LLMEngine(Config(model=path, block_size=BS, kv_pool_tokens=16 * BS, max_model_len=160,
                                max_batched_tokens=64))
    assert long.max_model_len == 160
    assert "past the model's context of 64 tokens" in caplog.text
    prompt = prompts(1, lengths=(120,))[0]
    got = run_greedy(long, prompt, max_tokens=40)
    assert len(got.tokens) == 40
    reference = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(got.first_logits, expected, atol=1e-4, rtol=1e-4)


def test_seed_reproduces_sampling_and_differs_across_seeds(engine):
    p = prompts(1)
    a = run(engine, p, SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))[0]["tokens"]
    b = run(engine, p, SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))[0]["tokens"]
    c = run(engine, p, SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))[0]["tokens"]
    assert a == b and a != c


def test_top_k_one_is_greedy(engine):
    p = prompts(1)
    greedy = run(engine, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]["tokens"]
    top1 = run(engine, p, SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))[0]["tokens"]
    tiny_p = run(engine, p, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, ignore_eos=True))[0]["tokens"]
    assert greedy == top1 == tiny_p


def test_logprobs_are_consistent(engine):
    out = run(engine, prompts(1), SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out["logprobs"]) == 5
    for lp, tok in zip(out["logprobs"], out["tokens"]):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0] == (tok, pytest.approx(lp.logprob))   # greedy: chosen is best
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_stop_string_cuts_text_and_finishes(engine):
    p = prompts(1)
    free = run(engine, p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    text = free["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"pick a stop string from {text!r}"
    cut = run(engine, p, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True))[0]
    assert cut["reason"] == "stop" and stop not in cut["text"]
    assert text.startswith(cut["text"]) and len(cut["tokens"]) < 20


def test_max_tokens_gives_length(engine):
    out = run(engine, prompts(1), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out["reason"] == "length" and len(out["tokens"]) == 3


def test_eos_finishes_with_stop(engine, monkeypatch):
    p = prompts(1)
    first = run(engine, p, SamplingParams(max_tokens=3, temperature=0.0))[0]["tokens"]
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({first[1]}))   # greedy reaches it 2nd
    out = run(engine, p, SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert out["reason"] == "stop" and out["tokens"] == first[:2]
    assert out["text"] == engine.tokenizer.decode(first[:1])    # EOS itself adds no text
    ignored = run(engine, p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert ignored["reason"] == "length" and ignored["tokens"] == first


def test_abort_frees_blocks(engine):
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    engine.abort_request("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_async_engine_streams_and_cancels(tiny_model_dir):
    eng = AsyncEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=64 * BS))

    async def main():
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = [o async for o in eng.generate("s", prompts(1)[0], params)]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 6
        with pytest.raises(RequestRejected):
            async for _ in eng.generate("r", [1] * 5000, params):
                pass
        gen = eng.generate("c", prompts(1)[0], SamplingParams(max_tokens=500, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()              # the caller leaves: the request is aborted
        await until_nothing_runs(eng)
    try:
        asyncio.run(main())
        stats = eng.stats()
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "float64"}, "dtype"), ({"device": "tpu"}, "device"), ({"block_size": 48}, "power of two"),
    ({"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "never downloads"),
    ({"kv_pool_tokens": 3}, "at least one block"), ({"gpu_memory_utilization": 1.5}, r"in \(0, 1\]"),
    ({"gpu_memory_utilization": "most"}, "a number"), ({"sse_keepalive": 0}, "sse_keepalive must be positive"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, float32, float16"),
    ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "keeps a float32 model's cache in 16 bits on CPU"),
])
def test_config_errors_name_the_problem(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Config(**kwargs)


def test_gpu_memory_utilization_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_GPU_MEMORY_UTILIZATION", "0.25")
    assert Config().gpu_memory_utilization == 0.25
    monkeypatch.delenv("KVTIER_GPU_MEMORY_UTILIZATION")
    assert Config().gpu_memory_utilization is None


def test_a_gpu_memory_utilization_bounds_the_pool_by_the_whole_device():
    gib = 2**30
    # no fraction: 80% of what is free after the weights
    assert cuda_pool_budget(free=70 * gib, total=80 * gib, held=10 * gib, reserve=0, utilization=None) == 56 * gib
    # a fraction of the device, less the engine's weights and a drafter's weights to come
    assert cuda_pool_budget(70 * gib, 80 * gib, 10 * gib, 2 * gib, 0.25) == 8 * gib
    # never more than the share of what is free (another process holds the rest), never below nothing
    assert cuda_pool_budget(5 * gib, 80 * gib, 1 * gib, 0, 0.5) == 4 * gib
    assert cuda_pool_budget(70 * gib, 80 * gib, 30 * gib, 0, 0.25) == 0


def test_the_cpu_pool_counts_the_page_cache_as_available():
    """A weight file just read sits in the page cache, which the kernel drops on demand: MemAvailable counts it,
    free pages do not (they made the default pool shrink by the file's size, as if the weights took twice their
    memory, and to almost nothing on a host whose RAM the cache had filled). The default is a share of the former."""
    meminfo = {line.split(":")[0]: line.split()[1] for line in open("/proc/meminfo")}
    available, free = int(meminfo["MemAvailable"]) * 1024, int(meminfo["MemFree"]) * 1024
    tokens = default_pool_tokens(1, torch.device("cpu"))
    # memory moves a little between the reads; where the cache holds more than 2% of the available memory (this
    # machine's: ~2 GB of 23), free pages would miss by more than this
    assert abs(tokens - available * CPU_POOL_SHARE) < 0.002 * available
    assert tokens >= 0.99 * free * CPU_POOL_SHARE


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"top_k": -2},
                                    {"logprobs": 50}, {"seed": 2**64}])
def test_sampling_params_reject_out_of_range(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_an_engine_dropped_without_shutdown_stops_its_tier_threads(tiny_model_dir, tmp_path):
    """Its tier mover's threads would keep the mover, the pool and the host tier's memory (pinned, on CUDA) alive
    for good: dropping the engine stops them (from a thread of its own) and frees the pool."""
    import gc
    import threading
    import time
    import weakref

    earlier = set(threading.enumerate())
    eng = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=64 * BS, kv_host_gib=0.01,
                           kv_disk_dir=str(tmp_path / "kv")))
    run(eng, prompts(2), SamplingParams(max_tokens=4, temperature=0.0))
    movers = [t for t in threading.enumerate()
              if t not in earlier and t.name in ("kvtier-saver", "kvtier-loader", "kvtier-pager")]
    assert len(movers) == 3
    pool = weakref.ref(eng.pool)
    del eng
    deadline = time.monotonic() + 30
    while (any(t.is_alive() for t in movers) or pool() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not any(t.is_alive() for t in movers)
    assert pool() is None
