"""Speculative decoding (--speculative ngram): proposals verified in one step, output exactly the target's, and only
accepted tokens ever becoming cache."""
import asyncio
import time

import pytest
import torch
from conftest import fill_random, until_nothing_runs

from kvtier.config import Config, ConfigError
from kvtier.engine.async_engine import AsyncEngine
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampler import probabilities
from kvtier.engine.sampling_params import SamplingParams
from kvtier.models import ggml_decoder
from kvtier.models.ggml_decoder import GgmlDecodeSteps
from kvtier.engine.verify import choose
from kvtier.kv.keys import chain_keys
from kvtier.spec.ngram import PromptLookup
from kvtier.spec.speculator import MAX_BACKOFF, PROBE_EVERY, REMEASURE_EVERY, Speculator

BS = 16


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    lookup = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4, 6, 7, 8, 3, 4]
    # "3 4" last occurred before the ending at 9..10 (followed by 6 7 8); "2 3 4" does not end the sequence
    assert lookup.propose(tokens, 3) == [6, 7, 8]
    tokens += [6, 7]
    # the longest ending that occurred before: "3 4 6 7" at 8..12, followed by 8 3 4 6 7 (what was appended since),
    # and then by what the copy itself wrote: 8 3 4 again
    assert lookup.propose(tokens, 8) == [8, 3, 4, 6, 7, 8, 3, 4]
    assert lookup.propose(tokens + [42], 4) == []          # nothing ends in 42 earlier


def longest_earlier_match(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup written out: for n from max_n down to min_n, the last earlier window equal to the ending, and
    the k tokens after it, copied one at a time from the sequence and the copy so far."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        ending = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == ending:
                copied = list(tokens)
                for i in range(k):
                    copied.append(copied[end + i])
                return copied[len(tokens):]
    return []


@pytest.mark.parametrize("bounds", [(2, 12), (1, 1), (3, 5)])
def test_ngram_search_grown_step_by_step_finds_the_longest_last_match(bounds):
    """Over random sequences of few distinct tokens (many matches of every length), fed a step at a time as a
    sequence grows, the search proposes what the written-out lookup does."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (400,), generator=gen).tolist()
    lookup = PromptLookup(*bounds)
    for end in range(1, len(tokens) + 1, 3):
        assert lookup.propose(tokens[:end], 6) == longest_earlier_match(tokens[:end], 6, *bounds), end


def test_ngram_proposes_a_loop_going_on():
    """A model caught in a loop of two tokens: the proposal repeats them for all k tokens, not only the two that
    followed the ending's last earlier occurrence."""
    tokens = [7, 8, 9] + [40, 41] * 6
    assert PromptLookup().propose(tokens, 7) == [40, 41, 40, 41, 40, 41, 40]


def test_ngram_looks_up_endings_of_the_lengths_it_is_given():
    tokens = [1, 2, 3, 9, 8, 2, 3]          # "2 3" occurred before (followed by 9 8), "1 2 3" did not
    assert PromptLookup().propose(tokens, 2) == [9, 8]
    assert PromptLookup(min_n=3, max_n=4).propose(tokens, 2) == []
    assert PromptLookup(min_n=1, max_n=1).propose([5, 6, 7, 6], 2) == [7, 6]     # "6" alone


def test_vllms_speculative_config_sets_the_options_it_names(tmp_path, capsys):
    """`--speculative-config` (vLLM's JSON) sets what the options do; a key or method kvtier lacks, a clash with an
    option, or a bad value is an error that names it."""
    from kvtier.cli import _config, _parser

    def config(*argv):
        return _config(_parser().parse_args(["serve", *argv]))

    c = config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 3, '
                                       '"prompt_lookup_max": 4}')
    assert (c.speculative, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 3, 4)
    draft = tmp_path / "draft.gguf"
    draft.touch()
    c = config("--speculative-config", f'{{"method": "draft_model", "model": "{draft}"}}', "--speculative", "draft")
    assert (c.speculative, c.draft_model) == ("draft", str(draft))
    for argv, message in (
            (['{"method": "eagle3"}'], "no method 'eagle3'"),
            (['{"method": "ngram", "disable_by_batch_size": 4}'], "no disable_by_batch_size"),
            (['{"num_speculative_tokens": "5"}'], "num_speculative_tokens must be an integer"),
            (['{"method": "ngram", "num_speculative_tokens": 5}', "--num-speculative-tokens", "3"], "say different"),
            (['{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}'], "prompt_lookup_min"),
            (['["ngram"]'], "JSON object"), (["{method: ngram}"], "not JSON")):
        with pytest.raises(SystemExit):
            config("--speculative-config", *argv)
        assert message in capsys.readouterr().err, argv


def test_speculator_proposes_what_pays_for_its_rows():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]        # "1 2" occurred before: 3 4 5 6 7 8 9 1 2 follow
    spec = Speculator("ngram", 4)
    spec.observe_step(decodes=1, drafted=0, seconds=0.010)
    for k in (2, 3, 4):
        spec.observe_step(decodes=1, drafted=k, seconds=0.010 + 0.0001 * k)    # a draft row costs 1% of a decode
    assert spec.draft_cost(4) == pytest.approx(0.04)
    state = spec.new_state()
    assert spec.propose(state, tokens, room=10) == [3, 4, 5, 6]    # cheap rows: the whole draft, up to k
    assert spec.propose(state, tokens, room=2) == [3, 4]           # never past what max_tokens leaves
    for _ in range(5):
        spec.verified(state, 4, 4, rejected=False)
    assert state.acceptance > 0.9
    costly = Speculator("ngram", 4)
    costly.observe_step(1, 0, 0.010)
    for k in (1, 2):
        costly.observe_step(1, k, 0.010 + 0.007 * k)     # a draft row costs 70% of a decode step
    state = costly.new_state()
    assert costly.propose(state, tokens, room=10) == [3]        # α = 0.75 at first: one token pays, two do not
    costly.verified(state, 1, 0, rejected=True)
    assert costly.propose(state, tokens, room=10) == []                # turned down: it sits out
    assert state.pause == PROBE_EVERY
    assert all(costly.propose(state, tokens, 10) == [] for _ in range(PROBE_EVERY))
    assert costly.propose(state, tokens, room=10) == [3]               # then probes with one token
    costly.verified(state, 1, 0, rejected=True)
    assert costly.propose(state, tokens, room=10) == [] and state.pause == PROBE_EVERY
    for _ in range(3):
        costly.verified(state, 4, 4, rejected=False)          # (as if) long runs accepted: longer proposals pay again
    state.pause = 0
    assert len(costly.propose(state, tokens, room=10)) > 1
    assert costly.stats()["proposed_tokens"] == 2 + 12


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.2, top_p=0.8)])
def test_a_verified_rows_token_follows_the_target_distribution(params):
    """The token taken at a sampled row (the draft's if it is the one drawn, else the one drawn: rejection
    sampling against a point-mass draft) follows the target's distribution: the frequencies of 20,000 seeded draws
    are within a few standard errors of p."""
    logits = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, 0.0, -2.0, 0.8])
    p = probabilities(logits[None], [params])[0]
    gen = torch.Generator().manual_seed(1234)
    draws = 20_000
    counts = torch.zeros_like(p)
    for _ in range(draws):
        counts[choose(logits, params, gen)] += 1
    stderr = (p * (1 - p) / draws).sqrt()
    assert ((counts / draws - p).abs() <= 5 * stderr + 1e-4).all(), (counts / draws, p)


def test_greedy_choice_takes_the_argmax():
    assert choose(torch.tensor([0.1, 3.0, 2.9]), SamplingParams(temperature=0.0), None) == 1


def test_unknown_methods_are_refused():
    with pytest.raises(ConfigError, match="draft-model"):
        Config(speculative="draft")
    with pytest.raises(ConfigError):
        Config(speculative="ngram", num_speculative_tokens=0)


# --- the engine, on a tiny random model --------------------------------------------------------------------------
# A random model copies nothing from its context, so prompt lookup would rarely propose what it says. These tests
# draft with an oracle instead: it proposes the output the model gives without speculation, with every MISTAKE-th
# proposed token wrong, so verify steps accept runs of tokens and reject others.

MISTAKE = 4


def engine_for(model_dir, speculative, **kw):
    settings = dict(model=model_dir, block_size=BS, kv_pool_tokens=64 * BS, max_batched_tokens=256, kv_host_gib=0,
                    kv_disk=False, speculative=speculative)
    return LLMEngine(Config(**{**settings, **kw}))


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return engine_for(tiny_model_dir, None)


@pytest.fixture(scope="module")
def speculating(tiny_model_dir):
    return engine_for(tiny_model_dir, "ngram")


def prompt(i: int, length: int = 60) -> list[int]:
    return [(11 * i + 7 * j) % 900 + 20 for j in range(length)]


def run(engine, prompts, params, abort_after=None):
    outs = {f"q{i}": {"tokens": [], "logprobs": []} for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}", ids, params)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            o = outs[out.request_id]
            o["tokens"] += out.new_token_ids
            o["logprobs"] += out.logprobs or []
            if out.finished:
                o["reason"], o["cached"] = out.finish_reason, out.num_cached_tokens
        steps += 1
        if abort_after is not None and steps == abort_after:
            engine.abort_request("q0")
    return [outs[f"q{i}"] for i in range(len(prompts))]


def oracle(monkeypatch, engine, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Make the engine's speculator propose each prompt's known output, every MISTAKE-th token wrong."""
    def propose(state, tokens, room, batch=1):
        for ids, out in zip(prompts, outputs):
            if tokens[:len(ids)] == ids and tokens[len(ids):] == out[:len(tokens) - len(ids)]:
                at = len(tokens) - len(ids)
                draft = out[at:at + min(engine.speculator.max_tokens, room)]
                return [t + 1 if (at + j) % MISTAKE == MISTAKE - 1 else t for j, t in enumerate(draft)]
        return []
    monkeypatch.setattr(engine.speculator, "propose", propose)


def same_with_oracle(monkeypatch, plain, speculating, prompts, params, **kw) -> tuple[list[dict], list[dict]]:
    """The runs without speculation and with the oracle drafting, which must have verified some tokens."""
    off = run(plain, prompts, params)
    oracle(monkeypatch, speculating, prompts, [o["tokens"] for o in off])
    before = dict(speculating.speculator.stats())
    on = run(speculating, prompts, params, **kw)
    stats = speculating.speculator.stats()
    accepted, proposed = (stats[k] - before[k] for k in ("accepted_tokens", "proposed_tokens"))
    assert 0 < accepted < proposed, "verify steps both accepted and rejected tokens"
    return off, on


def test_greedy_output_is_the_same_with_and_without_speculation(monkeypatch, plain, speculating):
    prompts = [prompt(i, 20 + 15 * i) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    off, on = same_with_oracle(monkeypatch, plain, speculating, prompts, params)
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    assert [o["reason"] for o in on] == ["length"] * 4
    for a, b in zip(on, off):      # a logprob per token, as without speculation
        assert [lp.token_id for lp in a["logprobs"]] == b["tokens"]
        assert [lp.logprob for lp in a["logprobs"]] == pytest.approx([lp.logprob for lp in b["logprobs"]], abs=1e-3)


def test_penalties_and_logit_bias_apply_at_every_verified_row(monkeypatch, plain, speculating):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5, logit_bias={100: 3.0, 200: -5.0})
    off, on = same_with_oracle(monkeypatch, plain, speculating, [prompt(2)], params)
    assert on[0]["tokens"] == off[0]["tokens"]


def test_a_seed_gives_the_same_text_with_and_without_speculation(monkeypatch, plain, speculating):
    """Each verified row draws its token as a decode step would, from the request's own generator."""
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    off, on = same_with_oracle(monkeypatch, plain, speculating, [prompt(4)], params)
    assert on[0]["tokens"] == off[0]["tokens"] and len(on[0]["tokens"]) == 30


def test_only_accepted_tokens_are_sealed(monkeypatch, plain, speculating):
    """Every block the speculating engine seals holds the request's own final tokens: a rejected proposal's K/V is
    never published, and the blocks reserved for it are given back."""
    sealed, truncated = [], []
    seal, truncate = speculating.pool.seal, speculating.kv.truncate
    monkeypatch.setattr(speculating.pool, "seal", lambda block, key: (sealed.append(key), seal(block, key)))

    def spy(state, end):
        truncate(state, end)
        truncated.append(len(state.block_table) == speculating.pool.blocks_for(end))
    monkeypatch.setattr(speculating.kv, "truncate", spy)
    ids = prompt(9, 70)
    _, (out,) = same_with_oracle(monkeypatch, plain, speculating, [ids],
                                 SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    tokens = ids + out["tokens"]
    ns = speculating.pool.namespace
    full = chain_keys(tokens[:(len(tokens) - 1) // BS * BS], BS, ns, None)    # the last token was never fed
    assert set(sealed[:-1]) <= set(full) and len(sealed) - 1 == len(full)    # and the finished partial block
    assert truncated and all(truncated)


def test_cache_reuse_is_the_same_with_and_without_speculation(monkeypatch, plain, speculating):
    """A three-turn conversation: the same outputs, and the same cached prompt tokens at each turn."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    history, prompts, outputs, turns = prompt(21, 50), [], [], []
    for turn in range(3):
        (out,) = run(plain, [history], params)
        prompts.append(history)
        outputs.append(out["tokens"])
        turns.append((out["tokens"], out["cached"]))
        history = history + out["tokens"] + prompt(30 + turn, 20)
    oracle(monkeypatch, speculating, prompts, outputs)
    spoken = [run(speculating, [ids], params)[0] for ids in prompts]
    assert [(o["tokens"], o["cached"]) for o in spoken] == turns
    assert all(cached > 0 for _, cached in turns[1:])


def test_mixed_batches_and_preemption_keep_greedy_output(monkeypatch, tiny_model_dir, plain):
    """Speculating and plain sequences share steps, in a pool small enough that some are preempted."""
    small = engine_for(tiny_model_dir, "ngram", kv_pool_tokens=12 * BS)
    prompts = [prompt(i, 48 + 10 * i) for i in range(5)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    off = run(plain, prompts, params)
    oracle(monkeypatch, small, prompts[::2], [o["tokens"] for o in off[::2]])     # the others decode plainly
    assert [o["tokens"] for o in run(small, prompts, params)] == [o["tokens"] for o in off]
    assert small.speculator.stats()["accepted_tokens"] > 0
    assert small.pool.num_free_blocks == small.pool.num_blocks


def wrong_drafts(monkeypatch, engine) -> None:
    """Every sequence proposes 7 tokens, all wrong (the tiny vocabulary's last ids, which it never says)."""
    monkeypatch.setattr(engine.speculator, "propose", lambda state, tokens, room, batch=1: [49_000] * min(7, room))


def test_a_draft_preempts_no_one_and_evicts_no_cached_block(monkeypatch, tiny_model_dir, plain):
    """In a 6-block pool where two requests just fit, drafts that need new blocks take only empty ones: no
    preemption, no cached block evicted, the same output."""
    small = engine_for(tiny_model_dir, "ngram", kv_pool_tokens=6 * BS)
    prompts = [prompt(50, 40), prompt(51, 40)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    wrong_drafts(monkeypatch, small)
    preempted, evicted = [], []
    preempt, allocate = small.scheduler._preempt, small.pool.allocate
    monkeypatch.setattr(small.scheduler, "_preempt", lambda seq, batch: (preempted.append(seq), preempt(seq, batch)))

    drafting = []
    reserve_draft = small.kv.reserve_draft

    def spy_draft(state, end, k):
        drafting.append(True)
        try:
            return reserve_draft(state, end, k)
        finally:
            drafting.pop()

    def spy(num_blocks, after=None, wants=0):      # a block for a draft comes from the empty ones
        evicted.append(bool(drafting) and num_blocks > small.pool.num_empty_blocks)
        return allocate(num_blocks, after, wants)
    monkeypatch.setattr(small.kv, "reserve_draft", spy_draft)
    monkeypatch.setattr(small.pool, "allocate", spy)
    for ids, p in zip(prompts, params):
        small.add_request(f"r{len(preempted)}{ids[0]}", ids, p)
    outs = {}
    while small.has_unfinished():
        for out in small.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    expected = [run(plain, [ids], p)[0]["tokens"] for ids, p in zip(prompts, params)]
    assert sorted(outs.values()) == sorted(expected)
    assert not preempted and not any(evicted)
    assert small.speculator.stats()["proposed_tokens"] > 0


def test_drafts_leave_a_small_budget_to_waiting_prompts(monkeypatch, tiny_model_dir):
    """With 8 tokens a step, a sequence proposing 7 still lets a prompt that arrives prefill beside it."""
    engine = engine_for(tiny_model_dir, "ngram", max_batched_tokens=8)
    wrong_drafts(monkeypatch, engine)
    batches = []
    run_batch = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda batch, capture=None: (
        batches.append([(seq.request_id, n, seq.num_drafted(n)) for seq, n in zip(batch.seqs, batch.num_tokens)]),
        run_batch(batch, capture))[1])
    engine.add_request("decoding", prompt(60, 8), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("prompt", prompt(61, 60), SamplingParams(max_tokens=1, temperature=0.0))
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["prompt", "decoding"]       # it did not wait for the speculating stream to end
    prefilling = [b for b in batches if any(rid == "prompt" for rid, _, _ in b)]
    drafting = [b for b in batches if any(d for _, _, d in b)]
    assert drafting and len(prefilling) <= 60 // 3 + 1      # at least 3 of its tokens a step (of 8)
    assert all(sum(n for _, n, _ in b) <= 8 for b in batches)


def test_stop_strings_and_max_tokens_cut_a_verified_run(monkeypatch, plain, speculating, bundled_tokenizer):
    ids = prompt(3)
    (full,) = run(plain, [ids], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    oracle(monkeypatch, speculating, [ids], [full["tokens"]])
    stop = bundled_tokenizer.decode(full["tokens"][20:22])
    for params in (SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])):
        (a,), (b,) = run(plain, [ids], params), run(speculating, [ids], params)
        assert a["tokens"] == b["tokens"] and a["reason"] == b["reason"]
    assert len(b["tokens"]) <= 22


def test_a_grammar_constrained_request_speculates(monkeypatch, plain, speculating):
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar='start: ("ab" | "cd" | " ")+ "."')
    off, on = same_with_oracle(monkeypatch, plain, speculating, [prompt(5)], params)
    assert on[0]["tokens"] == off[0]["tokens"]


def test_cancel_during_a_verify_step_frees_its_blocks(monkeypatch, plain, speculating):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    free = speculating.pool.num_free_blocks
    same_with_oracle(monkeypatch, plain, speculating, [prompt(7, 100)], params, abort_after=6)
    assert speculating.pool.num_free_blocks == free
    assert not speculating.scheduler.has_unfinished()


@pytest.mark.parametrize("policy", ["lru", "meankey"])
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_bounded_sequences_speculate_with_the_resident_sets_of_their_decode_steps(monkeypatch, tiny_model_dir,
                                                                                  policy, quantize):
    """Under bounded residency (8 blocks of 16 for a 600-token prompt, reselecting every 4 tokens), a verify step's
    rows attend to the blocks the decode steps would, the pager commits them row by row, and the greedy output is
    the one decoding without speculation, while blocks are paged out and in along the way. With quantized weights on
    CPU ggml's graphs run the bounded decode and verify steps too (handing the pager their queries), so every row
    scores bitwise as its decode would: the logprobs are the same to the bit."""
    settings = dict(kv_resident_tokens=8 * BS, kv_policy=policy, kv_reselect_every=4, kv_pool_tokens=120 * BS,
                    max_batched_tokens=64, kv_host_gib=1, quantize=quantize)
    plain_bounded = engine_for(tiny_model_dir, None, **settings)
    bounded = engine_for(tiny_model_dir, "ngram", **settings)
    ids = [(13 * i + 5) % 900 + 20 for i in range(600)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    (off,) = run(plain_bounded, [ids], params)
    oracle(monkeypatch, bounded, [ids], [off["tokens"]])
    drafts = []
    verify = bounded._verify
    monkeypatch.setattr(bounded, "_verify", lambda seq, n, logits, queries: (drafts.append(n - 1),
                                                                             verify(seq, n, logits, queries))[1])
    (on,) = run(bounded, [ids], params)
    assert on["tokens"] == off["tokens"]
    if quantize == "int8" and bounded.runner.device.type == "cpu":
        assert on["logprobs"] == off["logprobs"]
        assert isinstance(bounded.runner.graphs, GgmlDecodeSteps) and bounded.runner.graphs.steps > 0
    elif quantize == "int8":    # CUDA: a verify step's rows run other kernels than a decode row (within rounding)
        assert [p.token_id for p in on["logprobs"]] == [p.token_id for p in off["logprobs"]]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(on["logprobs"], off["logprobs"])) < 1e-4
    stats = bounded.stats()["residency"]
    assert stats["page_outs"] > 0 and stats["reselects"] > 0
    assert drafts and max(drafts) < BS and bounded.speculator.stats()["accepted_tokens"] > 0
    assert bounded.pool.num_free_blocks == bounded.pool.num_blocks


def test_ggml_steps_hand_the_pager_the_queries_an_eager_step_would(tiny_model_dir):
    """A bounded sequence's decode steps through ggml's graphs hand back each layer's queries after RoPE as the eager
    decoder captures them ([rows, layers, heads, head_dim]): the same numbers, within the two paths' rounding."""
    settings = dict(kv_resident_tokens=8 * BS, kv_pool_tokens=120 * BS, max_batched_tokens=64, kv_host_gib=1,
                    quantize="int8", device="cpu")
    got = {}
    for eager in (False, True):
        engine = engine_for(tiny_model_dir, None, enforce_eager=eager, **settings)
        assert isinstance(engine.runner.graphs, GgmlDecodeSteps) != eager
        steps, run_step = [], engine.runner.run

        def recording(batch, capture=None, run_step=run_step, steps=steps):
            logits, queries = run_step(batch, capture)
            if batch.num_tokens == [1] and batch.seqs[0].num_computed_tokens >= batch.seqs[0].num_prompt_tokens:
                steps.append(queries[0])
            return logits, queries
        engine.runner.run = recording
        run(engine, [prompt(3, 200)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        got[eager] = steps
    assert len(got[False]) == len(got[True]) == 3
    for graph, eager in zip(got[False], got[True]):
        assert graph.shape == eager.shape == (1, 2, 4, 16) and graph.is_contiguous()
        assert (graph - eager).abs().max() <= 0.02 * eager.abs().max()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_restored_conversation_speculates_from_its_first_step(monkeypatch, tmp_path, tiny_model_dir, plain, tier):
    """A prefix restored from the host tier (device cache off) or from disk after a restart: its first decode step
    is already a verify step (prompt lookup needs only the tokens), with the same output and cached tokens."""
    ids = prompt(40, 150)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    (expected,) = run(plain, [ids], params)
    settings = dict(kv_disk_dir=str(tmp_path), prefix_cache=tier == "disk", kv_host_gib=0.05 if tier == "host" else 0,
                    kv_disk=tier == "disk")
    first = engine_for(tiny_model_dir, "ngram", **settings)
    run(first, [ids], params)        # stepping until nothing is unfinished waits for its saves too
    if tier == "disk":
        first.shutdown()
    engine = first if tier == "host" else engine_for(tiny_model_dir, "ngram", **settings)
    oracle(monkeypatch, engine, [ids], [expected["tokens"]])
    starts = []
    verify = engine._verify
    monkeypatch.setattr(engine, "_verify", lambda seq, n, logits, queries: (starts.append(seq.num_computed_tokens),
                                                                            verify(seq, n, logits, queries))[1])
    (restored,) = run(engine, [ids], params)
    assert restored["tokens"] == expected["tokens"]
    assert restored["cached"] >= len(ids) // BS * BS - BS
    assert engine.stats()["tiers"][tier]["hit_blocks"] > 0
    assert starts and starts[0] == len(ids)       # the step after the prompt's first token
    engine.shutdown()


def test_async_engine_streams_a_speculating_request(tiny_model_dir):
    """Through the engine thread, warmed up as a server is, and cancelled while it speculates."""
    eng = AsyncEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=64 * BS, kv_host_gib=0,
                             kv_disk=False, speculative="ngram"))

    async def main():
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outs = [o async for o in eng.generate("a", prompt(8), params)]
        assert sum(len(o.new_token_ids) for o in outs) == 30
        gen = eng.generate("c", prompt(9), SamplingParams(max_tokens=500, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        await until_nothing_runs(eng)
    try:
        asyncio.run(main())
        stats = eng.stats()
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        assert "speculation" in stats
    finally:
        eng.shutdown()


# --- the bundled model, through ggml's decode graphs --------------------------------------------------------------

@pytest.mark.integration
def test_the_bundled_model_accepts_every_proposal_of_its_own_greedy_output(monkeypatch):
    """An oracle drafter that proposes the greedy continuation itself: every proposal is accepted, which holds only
    if a verify step's rows score exactly as one-token decode steps do (ggml's graph, bitwise). No prefix cache: each
    run computes the prompt in one chunk (a cached prompt's tail computed in a chunk of its own rounds differently,
    which can flip a near-tie in either run)."""
    engine = LLMEngine(Config(kv_host_gib=0, kv_disk=False, prefix_cache=False, speculative="ngram",
                              num_speculative_tokens=5))
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two "
                                                                  "numbers, then explain it."}])
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(engine.speculator, "propose", lambda state, tokens, room, batch=1: [])
    (plain,) = run(engine, [prompt], params)
    future = plain["tokens"]
    monkeypatch.setattr(engine.speculator, "propose",
                        lambda state, tokens, room, batch=1: future[len(tokens) - len(prompt):][:min(5, room)])
    before = engine.speculator.stats()
    (oracle,) = run(engine, [prompt], params)
    stats = engine.speculator.stats()
    assert oracle["tokens"] == future
    proposed = stats["proposed_tokens"] - before["proposed_tokens"]
    assert proposed >= 30 and stats["accepted_tokens"] - before["accepted_tokens"] == proposed
    assert stats["verify_steps"] - before["verify_steps"] <= 48 // 5 + 1


@pytest.mark.integration
def test_the_bundled_model_copies_faster_with_the_same_output():
    """An editing turn on the bundled model (quantized weights, ggml's graphs): the same greedy text, in fewer
    steps."""
    engines = [LLMEngine(Config(kv_host_gib=0, kv_disk=False, speculative=s)) for s in (None, "ngram")]
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12))
    prompt = engines[0].tokenizer.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n\n"
                                                        + code}])
    params = SamplingParams(max_tokens=80, temperature=0.0)
    outs, steps = [], []
    for engine in engines:
        engine.add_request("edit", prompt, params)
        tokens, n = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            n += 1
        outs.append(tokens)
        steps.append(n)
    assert outs[0] == outs[1]
    assert steps[1] < 0.7 * steps[0], steps


@pytest.mark.integration
def test_the_bundled_model_under_bounded_residency_verifies_rows_as_it_decodes_them(monkeypatch):
    """Bounded residency (the pager reads every step's queries) on the bundled model's quantized weights: its verify
    steps score each row bitwise as its decode step would, so text and logprobs are those without speculation (they
    once ran eagerly, attending as a prompt chunk, which changed the story at its 7th token)."""
    settings = dict(kv_host_gib=1, kv_disk=False, kv_resident_tokens=256)
    plain_bounded, bounded = (LLMEngine(Config(**settings, speculative=s)) for s in (None, "ngram"))
    ids = bounded.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}])
    params = SamplingParams(max_tokens=80, temperature=0.0, logprobs=0)
    (off,) = run(plain_bounded, [ids], params)
    oracle(monkeypatch, bounded, [ids], [off["tokens"]])
    (on,) = run(bounded, [ids], params)
    assert bounded.speculator.stats()["accepted_tokens"] > 0
    assert on["tokens"] == off["tokens"] and on["logprobs"] == off["logprobs"]


def served_and_plain(args: list[str], messages: list[dict], log):
    """A greedy answer of at most 60 tokens from `kvtier serve ARGS` through the openai client, the server's /metrics
    after it, and the engine (the bundled model, no speculation) with its own greedy run of the same messages. The
    server runs on the engine's thread count: torch's prompt products round by it on some CPUs."""
    import httpx
    from openai import OpenAI

    from conftest import kvtier_server, scrape
    with kvtier_server([*args, "--threads", str(torch.get_num_threads())], log) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0)
        metrics = scrape(httpx.Client(base_url=url))
    engine = LLMEngine(Config(kv_host_gib=0, kv_disk=False))
    (plain,) = run(engine, [engine.tokenizer.apply_chat_template(messages)], SamplingParams(max_tokens=60,
                                                                                          temperature=0.0))
    return answer, metrics, engine, plain


@pytest.mark.integration
def test_the_server_speculates_and_reports_it(tmp_path):
    """`kvtier serve` speculating by prompt lookup (asked as vLLM users ask: --speculative-config) through the openai
    client: the same greedy answer as the engine gives without speculation, its counters in /metrics, and the
    request's log line saying how many tokens were accepted."""
    log = tmp_path / "server.log"
    code = "\n".join(f"value_{i} = compute({i}, {i + 1})" for i in range(20))
    messages = [{"role": "user", "content": f"Repeat these lines exactly:\n\n{code}"}]
    spec = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4}'
    answer, metrics, engine, plain = served_and_plain(["--speculative-config", spec, "--no-kv-disk", "--kv-host-gib",
                                                       "0"], messages, log)
    assert answer.usage.completion_tokens == len(plain["tokens"])
    assert answer.choices[0].message.content.strip() == engine.tokenizer.decode(plain["tokens"]).strip()
    assert metrics['kvtier_spec_accepted_tokens_total{method="ngram"}'] > 0
    assert metrics['kvtier_spec_mean_acceptance_length{method="ngram"}'] > 1
    assert "proposed tokens accepted" in log.read_text()


@pytest.mark.integration
@pytest.mark.parametrize("start", [1000, 1020])
def test_a_verify_steps_rows_score_bitwise_as_decode_steps(start):
    """ggml's graph of a verify step (9 rows after a context of random K/V, 2 threads) against the same rows decoded
    one by one: identical logits and identical K/V written into the pool. Starting at 1020, the step's last rows
    pass a 256-token context boundary its first rows do not: each row attends over its own rounded context, as its
    decode step would (ggml's attention sums another way over more keys, even masked ones, and a verify step
    changed the greedy text). (ggml's attention over several query rows at once differed too, from the 5th row on.)"""
    engine = LLMEngine(Config(kv_host_gib=0, kv_disk=False, num_threads=2, kv_pool_tokens=4096))
    steps, pool, bs = engine.runner.graphs, engine.pool, engine.pool.block_size
    fill_random(pool, 0)
    table, rows = list(range(engine.pool.blocks_for(1100))), 9

    def run(ids: list[int], first: int, n: int) -> torch.Tensor:
        end = first + n
        return steps.run(ids[first - start:end - start], list(range(first, end)), list(range(first, end)),
                         [table[:-(-end // bs)]], [end], [n]).clone()
    for ids in ([100 + i for i in range(rows)], [100 + 37 * i for i in range(rows)], [5000] * rows):
        verified = run(ids, start, rows)
        written = pool.slots_kv(torch.arange(start, start + rows))
        decoded = torch.cat([run(ids, start + j, 1) for j in range(rows)])
        assert torch.equal(verified, decoded)
        assert torch.equal(written, pool.slots_kv(torch.arange(start, start + rows)))


def test_a_speculator_that_always_verifies_measures_a_decode_step_now_and_then():
    spec = Speculator("draft", 8)
    for _ in range(REMEASURE_EVERY):
        assert not spec.measure_now()
        spec.observe_step(decodes=1, drafted=4, seconds=0.03)
    assert spec.measure_now() and spec.decode_seconds is None
    assert not spec.measure_now()        # once: a step with prompt tokens measures nothing, and speculation goes on
    spec.observe_step(decodes=1, drafted=0, seconds=0.01)
    assert not spec.measure_now() and spec.decode_seconds == 0.01
    spec.observe_step(decodes=1, drafted=4, seconds=0.03)
    assert spec.draft_cost(4) == pytest.approx(2.0)


@pytest.mark.parametrize("method", ["draft", "dflash"])
def test_a_model_drafter_that_does_not_pay_probes_less_and_less_often(method):
    """Its rounds (a draft model's) or block (DFlash's) cost more than the tokens they bring: each probe that finds
    nothing paying doubles the pause."""
    spec = Speculator(method, 8)
    if method == "draft":
        assert spec.draft_cost(1) > 1        # until measured, a round costs a decode step
    spec.observe_step(1, 0, 0.010)
    spec.observe_step(1, 1, 0.035)       # one round and one verify row: 2.5 decode steps
    state = spec.new_state()
    pauses = []
    for _ in range(6):
        assert spec.plan(state, room=100) == 0
        pauses.append(state.pause)
        state.pause = 0
        assert spec.plan(state, room=100) == 1      # the probe
        spec.verified(state, 1, 1, rejected=False)
    assert pauses == [PROBE_EVERY << min(i, MAX_BACKOFF) for i in range(6)]
    for _ in range(30):
        spec.observe_step(1, 1, 0.0101)  # rounds became cheap: a k pays, and the pauses start over
    assert spec.plan(state, room=100) > 0 and state.backoff == 0


def slow_builds_and_learned_times(monkeypatch, engine) -> dict[str, list[float]]:
    """Each ggml graph built from here on takes 1 s more; the step times the speculator and the pacer learn from,
    recorded as they are handed over."""
    build = ggml_decoder._Step.__init__

    def slow_build(*args):
        time.sleep(1.0)
        build(*args)
    monkeypatch.setattr(ggml_decoder._Step, "__init__", slow_build)
    learned = {"speculator": [], "pacer": []}
    for name, learner, method in (("speculator", engine.speculator, "observe_step"),
                                  ("pacer", engine.scheduler.pacer, "observe")):
        monkeypatch.setattr(learner, method, lambda *args, name=name, observe=getattr(learner, method):
                            (learned[name].append(args[-1]), observe(*args))[1])
    return learned


def test_building_a_graph_for_a_new_step_shape_is_not_what_its_rows_cost(monkeypatch, tiny_model_dir):
    """ggml's decode graphs are built on a step shape's first use: a first verify step of k rows pays a build, which
    the speculator must not learn as what k rows cost (it would not propose k rows again), nor the pacer as a decode
    step's time. Here each build takes 1 s more, hundreds of the tiny model's decode steps, and no step time either
    learns comes near it (a first step, or one beside a busy worker, may take a tenth of it)."""
    settings = dict(quantize="int8", device="cpu")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [prompt(5, 40)]
    off = run(engine_for(tiny_model_dir, None, **settings), prompts, params)
    engine = engine_for(tiny_model_dir, "ngram", **settings)
    assert isinstance(engine.runner.graphs, GgmlDecodeSteps)
    oracle(monkeypatch, engine, prompts, [o["tokens"] for o in off])
    proposals, steps = engine.speculator.propose, []

    def every_other_step(state, tokens, room, batch=1):
        """Decode steps between verify steps of 1 and 2 draft rows, so that the speculator measures both."""
        steps.append(len(tokens))
        return [] if len(steps) % 2 else proposals(state, tokens, room, batch)[:len(steps) // 2 % 2 + 1]
    monkeypatch.setattr(engine.speculator, "propose", every_other_step)
    learned = slow_builds_and_learned_times(monkeypatch, engine)
    assert run(engine, prompts, params)[0]["tokens"] == off[0]["tokens"]
    assert len(engine.speculator.draft_costs) >= 2 and engine.runner.graphs.build_seconds >= 3
    assert learned["speculator"] and learned["pacer"]
    assert max(learned["speculator"] + learned["pacer"]) < 0.5, learned


def test_a_draft_models_graph_builds_are_not_what_its_rounds_cost(monkeypatch, tiny_model_dir):
    """The draft model's own decode graphs, built as its rounds take new shapes, are left out of what the speculator
    learns its rounds cost and of the pacer's step times too."""
    engine = engine_for(tiny_model_dir, "draft", draft_model=tiny_model_dir, quantize="int8", device="cpu")
    assert isinstance(engine.drafter.runner.graphs, GgmlDecodeSteps)
    learned = slow_builds_and_learned_times(monkeypatch, engine)
    run(engine, [prompt(6, 40)], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert engine.speculator.accepted > 0 and engine.drafter.build_seconds >= 2
    assert max(learned["speculator"] + learned["pacer"]) < 0.5, learned
