"""Speculative decoding with a DFlash block drafter (--speculative dflash --draft-model DIR), random weights: the
target's output unchanged, and the drafter's state over a conversation (K/V from the target's hidden features)
cached, saved and restored from the tiers, so a restored conversation proposes what the uninterrupted one does."""
import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file
from test_draft_model import (BOUNDED, bounded_drafter_keeps_its_window, bounded_drafts_as_uninterrupted, counts,
                              drafts_as_uninterrupted)
from test_speculation import BS, engine_for, prompt, run

from kvtier.config import Config, ConfigError
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.keys import chain_keys
from kvtier.models.decoder import apply_rope
from kvtier.models.dflash import load_dflash
from kvtier.models.ggml_decoder import GgmlDecodeSteps
from kvtier.models.loader import hf_config
from kvtier.spec.dflash import WRITE_AFTER

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
BLOCK = 5          # the drafter proposes 4 tokens after the last one


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory, tiny_model_dir):
    """A one-layer DFlash drafter of random weights for the tiny model, as z-lab lays a checkpoint out."""
    with open(f"{tiny_model_dir}/config.json") as f:
        target = json.load(f)
    hidden, heads, kv_heads, head_dim, ff = target["hidden_size"], 4, 2, 16, 128
    path = tmp_path_factory.mktemp("dflash")
    config = {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": hidden,
              "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "intermediate_size": ff, "vocab_size": target["vocab_size"],
              "max_position_embeddings": target["max_position_embeddings"], "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "block_size": BLOCK, "num_target_layers": target["num_hidden_layers"],
              "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 3}}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(3)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5
    layer = {"self_attn.q_proj.weight": w(heads * head_dim, hidden), "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
             "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden), "self_attn.o_proj.weight": w(hidden, heads * head_dim),
             "self_attn.q_norm.weight": torch.ones(head_dim), "self_attn.k_norm.weight": torch.ones(head_dim),
             "input_layernorm.weight": torch.ones(hidden), "post_attention_layernorm.weight": torch.ones(hidden),
             "mlp.gate_proj.weight": w(ff, hidden), "mlp.up_proj.weight": w(ff, hidden), "mlp.down_proj.weight": w(hidden, ff)}
    weights = {f"layers.0.{name}": t for name, t in layer.items()} | {
        "fc.weight": w(hidden, 2 * hidden), "hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden)}
    save_file(weights, path / "model.safetensors")
    return str(path)


def drafting(target, drafter, **kw):
    """Every sequence proposes all the drafter gives (rows that cost nothing): steps that do not depend on timing."""
    engine = engine_for(target, "dflash", draft_model=drafter, num_speculative_tokens=BLOCK - 1, **kw)
    engine.speculator.draft_cost = lambda k: 0.0
    return engine


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return engine_for(tiny_model_dir, None)


def test_the_drafter_changes_nothing_but_the_steps(plain, tiny_model_dir, dflash_dir):
    prompts = [prompt(i) for i in range(3)]
    engine = drafting(tiny_model_dir, dflash_dir)
    for params in (GREEDY, SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7)):
        assert [o["tokens"] for o in run(engine, prompts, params)] == \
            [o["tokens"] for o in run(plain, prompts, params)]
    assert counts(engine)[1] > 0 and engine.stats()["speculation"]["method"] == "dflash"
    assert engine.drafter.pool.num_free_blocks == engine.drafter.pool.num_blocks


def hands_the_drafter_its_features(monkeypatch, engine, plain, graphs, params=GREEDY):
    """Decode and verify steps from `graphs` hand back the drafter's features as eager steps do: the same output as
    without speculation, the drafter's state written from the graphs' steps and proposing, no request lost. The long
    prompt prefills while the others decode: steps mixed, where ggml's graphs take the decodes."""
    observed, lost = [], set()       # the graphs' steps so far at each observation; requests the drafter lost
    observe = engine.drafter.observe

    def observing(seq, start, features):
        observed.append(graphs.steps)
        observe(seq, start, features)
        lost.update(engine.drafter.lost)      # a request's entry goes when it ends
    monkeypatch.setattr(engine.drafter, "observe", observing)
    prompts = [prompt(0), prompt(1), prompt(2, length=300)]
    assert [o["tokens"] for o in run(engine, prompts, params)] == [o["tokens"] for o in run(plain, prompts, params)]
    assert graphs.steps > 0 and observed.count(0) < len(observed)     # features from the graphs' steps too
    assert counts(engine)[1] > 0 and not lost


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the graphs' decode kernel runs in Triton's "
                    "interpreter on CPU")
def test_decode_graphs_hand_the_drafter_its_features(monkeypatch, plain, tiny_model_dir, dflash_dir):
    """The CUDA graphs, from their buffers (uncaptured, on CPU)."""
    from kvtier.engine.graphs import DecodeGraphs
    engine = drafting(tiny_model_dir, dflash_dir)
    graphs = engine.runner.graphs = DecodeGraphs(engine.model, engine.pool, engine.config.max_num_seqs,
                                                 engine.max_model_len, capture=False, rows_per_seq=BLOCK,
                                                 feature_layers=engine.drafter.feature_layers)
    # fewer tokens: each step runs the kernels in Triton's interpreter
    hands_the_drafter_its_features(monkeypatch, engine, plain, graphs, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                      ignore_eos=True))


def test_ggml_decode_steps_hand_the_drafter_its_features(monkeypatch, tiny_model_dir, dflash_dir):
    """ggml's graphs, which decode quantized weights on CPU (the target no longer runs eagerly under dflash)."""
    on_cpu = dict(quantize="int8", device="cpu")
    engine = drafting(tiny_model_dir, dflash_dir, **on_cpu)
    assert isinstance(engine.runner.graphs, GgmlDecodeSteps)
    plain_on_cpu = engine_for(tiny_model_dir, None, **on_cpu)
    hands_the_drafter_its_features(monkeypatch, engine, plain_on_cpu, engine.runner.graphs)


def recording_writes(monkeypatch, engine) -> tuple[list[bytes], list[int]]:
    """The keys of the blocks the drafter seals, and the rows of each of its K/V writes, from here on."""
    pool, sealed, written = engine.drafter.pool, [], []
    seal, context_kv = pool.seal, engine.drafter.model.context_kv
    monkeypatch.setattr(pool, "seal", lambda block, key: (sealed.append(key), seal(block, key)))
    monkeypatch.setattr(engine.drafter.model, "context_kv", lambda f, p: (written.append(len(p)), context_kv(f, p))[1])
    return sealed, written


def conversation_blocks(engine, tokens: list[int]) -> set[bytes]:
    """The drafter's keys of the full blocks of a conversation's tokens but the last (computed)."""
    bs = engine.drafter.pool.block_size
    return set(chain_keys(tokens[:(len(tokens) - 1) // bs * bs], bs, engine.drafter.pool.namespace, None))


def test_the_drafters_state_is_sealed_for_the_conversations_tokens(monkeypatch, tiny_model_dir, dflash_dir):
    """Its blocks hold the K/V of the target's features at the conversation's own tokens, under a namespace of its
    own; a next turn writes only its new tokens' K/V."""
    engine = drafting(tiny_model_dir, dflash_dir)
    sealed, written = recording_writes(monkeypatch, engine)
    ids = prompt(9, 70)
    (out,) = run(engine, [ids], GREEDY)
    tokens = ids + out["tokens"]
    assert engine.drafter.pool.namespace != engine.pool.namespace
    assert set(sealed[:-1]) == conversation_blocks(engine, tokens)     # and the finished partial block
    assert sum(written) == len(tokens) - 1
    written.clear()
    follow_up = tokens + prompt(10, 20)
    run(engine, [follow_up], GREEDY)
    assert sum(written) < 20 + 40 + BS       # the new message and the answer, not the history


def test_a_sequence_that_sits_out_pays_for_no_drafter_work_until_it_proposes(monkeypatch, tiny_model_dir, dflash_dir):
    """While the speculator has a sequence propose nothing (a drafter whose proposals do not pay), its steps write
    none of the drafter's state: the rows wait and are written in one forward when it proposes again, when
    WRITE_AFTER wait, or when the request ends, and the drafter's blocks are the conversation's all the same."""
    engine = drafting(tiny_model_dir, dflash_dir)
    monkeypatch.setattr(engine.speculator, "plan", lambda state, room, batch=1: 0)
    sealed, written = recording_writes(monkeypatch, engine)
    ids = prompt(12, 100)
    (out,) = run(engine, [ids], SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True))
    # the prompt's chunk, the first WRITE_AFTER decode rows once they waited, the rest at the end
    assert written == [len(ids), WRITE_AFTER, len(out["tokens"]) - 1 - WRITE_AFTER]
    assert set(sealed[:-1]) == conversation_blocks(engine, ids + out["tokens"])


def test_rows_written_after_a_bounded_request_ends_are_keyed_bounded(monkeypatch, tiny_model_dir, dflash_dir):
    """Under bounded residency a sequence that sits out has its drafter rows written as it ends, after the model's
    residency was given back: the rows whose features came from the model's window are keyed bounded all the same."""
    engine = drafting(tiny_model_dir, dflash_dir, **BOUNDED)
    monkeypatch.setattr(engine.speculator, "plan", lambda state, room, batch=1: 0)
    pager, namespaces = engine.drafter.kv.pager, []
    namespace_for = pager.namespace_for
    monkeypatch.setattr(pager, "namespace_for", lambda state, block: (
        namespaces.append(namespace_for(state, block)), namespaces[-1])[1])
    ids = [(13 * i + 5) % 900 + 20 for i in range(600)]
    run(engine, [ids], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert namespaces[0] == engine.drafter.pool.namespace and namespaces[-1] == pager.bounded_namespace


def test_a_verify_step_that_goes_bounded_and_ends_the_request_keys_its_rows_bounded(monkeypatch, tiny_model_dir,
                                                                                    dflash_dir):
    """The first decode step over the model's window is a verify step that completes a block and ends the request:
    the drafter sees the step's features before the request's residency is given back, so that block is keyed
    bounded."""
    ids = [(13 * i + 5) % 900 + 20 for i in range(40 * BS - 3)]     # a draft of 2 completes the last block
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)      # ends with that step's token
    want = run(engine_for(tiny_model_dir, None, **BOUNDED), [ids], params)[0]["tokens"]
    engine = drafting(tiny_model_dir, dflash_dir, **BOUNDED)
    drafts_the_answer(monkeypatch, engine, want)
    pager, namespaces = engine.drafter.kv.pager, []
    namespace_for = pager.namespace_for
    monkeypatch.setattr(pager, "namespace_for", lambda state, block: (
        namespaces.append(namespace_for(state, block)), namespaces[-1])[1])
    assert run(engine, [ids], params)[0]["tokens"] == want and counts(engine) == (2, 2)
    assert len(namespaces) == 40 and namespaces[-1] == pager.bounded_namespace != namespaces[0]


def drafts_the_answer(monkeypatch, engine, answer: list[int]) -> None:
    """The drafter does its own work, then proposes the answer's next tokens."""
    propose = engine.drafter.propose

    def oracle(wanted, prefilling):
        seconds = propose(wanted, prefilling)
        for seq, k in wanted:
            seq.draft = answer[seq.num_output_tokens:seq.num_output_tokens + k]
        return seconds
    monkeypatch.setattr(engine.drafter, "propose", oracle)


def test_a_request_whose_step_fails_after_it_was_verified_is_output_once_as_failed(monkeypatch, plain,
                                                                                    tiny_model_dir, dflash_dir):
    engine = drafting(tiny_model_dir, dflash_dir)
    drafts_the_answer(monkeypatch, engine, run(plain, [prompt(0)], GREEDY)[0]["tokens"])
    observe = engine.drafter.observe

    def broken(seq, start, features):      # fails on the request's first verify step that accepts a token
        if start >= seq.num_prompt_tokens and seq.num_computed_tokens - start > 1:
            raise RuntimeError("the drafter broke")
        observe(seq, start, features)
    monkeypatch.setattr(engine.drafter, "observe", broken)
    engine.add_request("q0", prompt(0), GREEDY)
    finished = []
    while engine.has_unfinished():
        finished += [out.finish_reason for out in engine.step() if out.finished]
    assert finished == ["error"]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_restored_conversation_drafts_what_the_uninterrupted_one_does(monkeypatch, tmp_path, tiny_model_dir,
                                                                         dflash_dir, tier):
    engine = drafts_as_uninterrupted(monkeypatch, tmp_path, tiny_model_dir,
                                     lambda **kw: drafting(tiny_model_dir, dflash_dir, **kw), tier)
    assert not engine.drafter.lost
    engine.shutdown()


def test_a_drafter_under_bounded_residency_keeps_its_window(monkeypatch, tiny_model_dir, dflash_dir):
    """Its block proposals attend to its resident blocks only: never more keys than the budget holds. It computes no
    prompt chunks, so no host memory is set aside to gather paged-out K/V for one (the draft model's is)."""
    keys = []

    def make(**kw):
        engine = drafting(tiny_model_dir, dflash_dir, **kw)
        block = engine.drafter.model.block
        monkeypatch.setattr(engine.drafter.model, "block", lambda embedded, positions, context: (
            keys.append(len(context[0][0])), block(embedded, positions, context))[1])
        return engine
    engine, _ = bounded_drafter_keeps_its_window(monkeypatch, tiny_model_dir, make)
    assert keys and max(keys) <= 8 * BS < 600
    assert engine.drafter.kv.stack.gather.buffer.numel() == 0 < engine.tiers.gather.buffer.numel()


def test_a_drafter_with_small_blocks_writes_in_pieces_its_budget_holds(tiny_model_dir, dflash_dir):
    """Under bounded residency the rows waiting to be written (up to 64) can span more blocks of 4 than the budget's
    8: the drafter writes them in pieces the budget holds, as the model's prompt chunks are, and goes on proposing."""
    settings = dict(BOUNDED, block_size=4, kv_resident_tokens=8 * 4)
    ids = [(13 * i + 5) % 900 + 20 for i in range(300)]
    want = run(engine_for(tiny_model_dir, None, **settings), [ids], GREEDY)[0]["tokens"]
    engine = drafting(tiny_model_dir, dflash_dir, **settings)
    assert run(engine, [ids], GREEDY)[0]["tokens"] == want
    assert counts(engine)[1] > 0 and engine.drafter.kv.pager.stats["page_outs"] > 0


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_bounded_conversation_restores_the_drafters_window(monkeypatch, tmp_path, tiny_model_dir, dflash_dir, tier):
    bounded_drafts_as_uninterrupted(monkeypatch, tmp_path, tiny_model_dir,
                                    lambda **kw: drafting(tiny_model_dir, dflash_dir, **kw), tier).shutdown()


def test_cancel_while_drafting_frees_both_pools(tiny_model_dir, dflash_dir):
    engine = drafting(tiny_model_dir, dflash_dir)
    run(engine, [prompt(7, 100), prompt(8, 90)], GREEDY, abort_after=6)
    for pool in (engine.pool, engine.drafter.pool):
        assert pool.num_free_blocks == pool.num_blocks
    assert not engine.drafter.shadows


def test_a_drafter_for_another_model_is_refused(tmp_path, tiny_model_dir, dflash_dir):
    config = json.loads(open(f"{dflash_dir}/config.json").read())
    config["dflash_config"]["target_layer_ids"] = [0, 7]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes(open(f"{dflash_dir}/model.safetensors", "rb").read())
    with pytest.raises(ValueError, match="another target"):
        drafting(tiny_model_dir, str(other))
    with pytest.raises(ConfigError, match="go together"):
        Config(speculative="dflash")


def test_steps_are_timed_as_they_ran(tiny_model_dir, dflash_dir):
    """The pacer and the speculator measure steps of a few milliseconds, as they are (the features' bookkeeping
    once clobbered the step's start time)."""
    engine = drafting(tiny_model_dir, dflash_dir)
    run(engine, [prompt(3)], GREEDY)
    assert 0 < engine.scheduler.pacer.pace(1) < 1
    assert all(cost < 100 for cost in engine.speculator.draft_costs.values())


def test_rows_written_as_they_waited_are_not_what_a_step_costs(monkeypatch, tiny_model_dir, dflash_dir):
    """A sequence that sits out has its WRITE_AFTER waiting rows written inside a decode step: the drafter's own work,
    which the speculator leaves out of what a decode step costs (else draft rows would look cheap beside it), while
    the pacer, which keeps the streams' pace, counts it."""
    engine = drafting(tiny_model_dir, dflash_dir)
    monkeypatch.setattr(engine.speculator, "plan", lambda state, room, batch=1: 0)
    context_kv = engine.drafter.model.context_kv

    def slow(features, positions):
        if len(positions) == WRITE_AFTER:
            time.sleep(2.0)
        return context_kv(features, positions)
    monkeypatch.setattr(engine.drafter.model, "context_kv", slow)
    learned, observe_step = [], engine.speculator.observe_step
    paced, observe = [], engine.scheduler.pacer.observe
    monkeypatch.setattr(engine.speculator, "observe_step",
                        lambda *a: (observe_step(*a), learned.append(engine.speculator.decode_seconds)))
    monkeypatch.setattr(engine.scheduler.pacer, "observe", lambda *a: (observe(*a), paced.append(a[-1])))
    run(engine, [prompt(12, 100)], SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True))
    assert engine.drafter.writing >= 2.0
    # the 2 s counted would take it past 0.4 (the speculator's SMOOTHING is 0.2); room below that for a step of a
    # few ms stalled by the processes beside it under make test (one reached 0.18)
    assert 0 < max(learned) < 0.25
    assert max(paced) >= 2.0


def test_a_block_stops_at_the_drafters_last_position(plain, tiny_model_dir, dflash_dir, caplog):
    """A prompt that ends next to the context limit: the blocks near it are shortened, never past the drafter's
    positions (no error), and the answer is the model's."""
    ids = [(7 * i) % 900 + 20 for i in range(2040)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = drafting(tiny_model_dir, dflash_dir, kv_pool_tokens=160 * BS)
    (expected,), (out,) = run(engine_for(tiny_model_dir, None, kv_pool_tokens=160 * BS), [ids], params), \
        run(engine, [ids], params)
    assert out["tokens"] == expected["tokens"] and counts(engine)[1] > 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_failing_drafter_costs_a_request_its_proposals_not_its_answer(monkeypatch, plain, tiny_model_dir,
                                                                      dflash_dir):
    engine = drafting(tiny_model_dir, dflash_dir)

    def broken(features, positions):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(engine.drafter.model, "context_kv", broken)
    ids = prompt(11)
    assert run(engine, [ids], GREEDY)[0]["tokens"] == run(plain, [ids], GREEDY)[0]["tokens"]
    assert counts(engine)[1] == 0 and engine.drafter.pool.num_free_blocks == engine.drafter.pool.num_blocks


def test_the_drafters_attention_is_softmax_attention_over_its_context_and_block(dflash_dir, tiny_model_dir):
    """Each query head over its K/V head's keys (the context's, then the block's own), unmasked, as written out."""
    drafter, _ = load_dflash(dflash_dir, hf_config(tiny_model_dir), torch.float32, torch.device("cpu"))
    attention = drafter.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    x, context = torch.randn(BLOCK, drafter.config.layers.hidden_size, generator=g), torch.randn(
        7, drafter.config.layers.hidden_size, generator=g)
    positions = torch.arange(7 + BLOCK)
    rope = drafter.rope(positions[7:], x.dtype)
    context_k, context_v = attention.kv(context, drafter.rope(positions[:7], x.dtype))
    with torch.no_grad():
        got = attention(x, rope, context_k, context_v)
        q = apply_rope(attention.q_norm(attention.q_proj(x).view(BLOCK, attention.heads, attention.head_dim)), *rope)
        k, v = attention.kv(x, rope)
        group = attention.heads // attention.kv_heads
        k, v = (torch.cat([c, t]).repeat_interleave(group, 1) for c, t in ((context_k, k), (context_v, v)))
        weights = torch.softmax(torch.einsum("thd,shd->hts", q, k) * attention.head_dim ** -0.5, -1)
        want = attention.o_proj(torch.einsum("hts,shd->thd", weights, v).reshape(BLOCK, -1))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
