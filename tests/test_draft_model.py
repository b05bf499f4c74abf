"""Speculative decoding with a draft model (--speculative draft --draft-model PATH): the target's output unchanged,
and the draft model's own KV content-addressed, cached and restored from the tiers as the target's is."""
import pytest
import torch
from test_speculation import BS, engine_for, prompt, run

from kvtier.config import Config, ConfigError
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.keys import chain_keys
from kvtier.spec.speculator import Speculator

NOISE = 0.3
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its second layer dropped and noise on every other weight (another shape, the same
    tokenizer): it proposes what the target says often, not always."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path_factory.mktemp("draft")
    for name in os.listdir(tiny_model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_model_dir, name), path)
    with open(path / "config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] = 1
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    generator = torch.Generator().manual_seed(1)
    weights = {}
    for file in os.listdir(tiny_model_dir):
        if file.endswith(".safetensors"):
            for name, w in load_file(os.path.join(tiny_model_dir, file)).items():
                if ".layers.1." not in name:
                    weights[name] = w + NOISE * w.std() * torch.randn(w.shape, generator=generator)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return engine_for(tiny_model_dir, None)


def drafting(target, draft, **kw):
    """An engine whose sequences each propose as many tokens as their acceptance pays for with rows that cost
    nothing: on a tiny model a draft round costs as much as the target's step, and the speculator would turn itself
    off; and the steps do not depend on timing."""
    engine = engine_for(target, "draft", draft_model=draft, **kw)
    engine.speculator.draft_cost = lambda k: 0.0
    return engine


def counts(engine) -> tuple[int, int]:
    stats = engine.speculator.stats()
    return stats["accepted_tokens"], stats["proposed_tokens"]


def record_drafts(monkeypatch, engine) -> list[tuple[int, list[int]]]:
    """(the target's length, the draft) of every proposal the engine makes."""
    drafts = []
    propose = engine.drafter.propose

    def spy(wanted, prefilling):
        seconds = propose(wanted, prefilling)
        drafts.extend((len(seq.token_ids), list(seq.draft)) for seq, _ in wanted if seq.draft)
        return seconds
    monkeypatch.setattr(engine.drafter, "propose", spy)
    return drafts


def test_a_model_drafting_for_itself_gives_the_same_output_and_most_proposals_accepted(plain, tiny_model_dir):
    """Greedy proposals of the target's own weights are its own greedy tokens (up to the last bits a decode and a
    verify row may differ by), and the output is the one without speculation."""
    prompts = [prompt(i) for i in range(3)]
    off = run(plain, prompts, GREEDY)
    engine = drafting(tiny_model_dir, tiny_model_dir)
    on = run(engine, prompts, GREEDY)
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    accepted, proposed = counts(engine)
    assert proposed > 0 and accepted >= 0.95 * proposed
    assert engine.drafter.pool.num_free_blocks == engine.drafter.pool.num_blocks


def test_another_draft_model_changes_nothing_but_the_steps(plain, tiny_model_dir, other_draft_dir):
    """A draft of other weights gets tokens rejected; the output, greedy, seeded or under a grammar, is the target's
    all the same."""
    prompts = [prompt(i) for i in range(3)]
    engine = drafting(tiny_model_dir, other_draft_dir)
    assert [o["tokens"] for o in run(engine, prompts, GREEDY)] == [o["tokens"] for o in run(plain, prompts, GREEDY)]
    accepted, proposed = counts(engine)
    assert 0 < accepted < proposed
    for params in (SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7),
                   SamplingParams(max_tokens=30, temperature=0.0, grammar='start: ("ab" | "cd" | " ")+ "."')):
        assert [o["tokens"] for o in run(engine, prompts, params)] == \
            [o["tokens"] for o in run(plain, prompts, params)]


def test_a_draft_of_a_shorter_context_drafts_past_it_with_a_warning(plain, tiny_model_dir, tmp_path, caplog):
    """A draft model trained on 32 tokens of context drafting for a target of 2,048 (it was refused, so a draft cut the
    target's context to its own): its RoPE covers every position the target serves, it still proposes past its
    context (here, being the target's weights, tokens the target accepts), and the output is the target's."""
    import json
    import shutil
    short = tmp_path / "short-draft"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    prompts = [prompt(i) for i in range(2)]     # 60 tokens, 40 more decoded
    with caplog.at_level("WARNING", logger="kvtier.spec"):
        engine = drafting(tiny_model_dir, str(short))
    assert "trained on 32 tokens of context, the model serves 2048" in caplog.text
    assert [o["tokens"] for o in run(engine, prompts, GREEDY)] == [o["tokens"] for o in run(plain, prompts, GREEDY)]
    accepted, proposed = counts(engine)
    assert proposed > 0 and accepted >= 0.9 * proposed
    engine.shutdown()


def test_only_the_targets_tokens_become_draft_cache(monkeypatch, tiny_model_dir, other_draft_dir):
    """Every block the draft model seals holds the conversation's own tokens under the draft namespace: the K/V of
    its rejected proposals is never published."""
    engine = drafting(tiny_model_dir, other_draft_dir)
    pool = engine.drafter.pool
    sealed = []
    seal = pool.seal
    monkeypatch.setattr(pool, "seal", lambda block, key: (sealed.append(key), seal(block, key)))
    ids = prompt(9, 70)
    (out,) = run(engine, [ids], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    accepted, proposed = counts(engine)
    assert 0 < accepted < proposed
    tokens = ids + out["tokens"]
    full = chain_keys(tokens[:(len(tokens) - 1) // BS * BS], BS, pool.namespace, None)   # the last, never fed
    assert pool.namespace != engine.pool.namespace
    assert set(sealed[:-1]) <= set(full) and len(set(sealed)) >= len(full)     # and the finished partial block
    assert pool.num_free_blocks == pool.num_blocks


def test_a_conversation_reuses_the_draft_models_cache(monkeypatch, plain, tiny_model_dir, other_draft_dir):
    """Three turns: the same outputs and cached tokens as without speculation, and the draft model computes only
    each turn's new tokens."""
    # 8 tokens a step at most: a turn's rounds then stay below what computing the whole history again would take
    engine = drafting(tiny_model_dir, other_draft_dir, num_speculative_tokens=8)
    computed = []
    run_draft = engine.drafter.runner.run
    monkeypatch.setattr(engine.drafter.runner, "run", lambda batch, capture=None: (
        computed.append(sum(n for seq, n in zip(batch.seqs, batch.num_tokens))), run_draft(batch, capture))[1])
    history = prompt(21, 50)
    for turn in range(3):
        (expected,) = run(plain, [history], GREEDY)
        computed.clear()
        (out,) = run(engine, [history], GREEDY)
        assert (out["tokens"], out["cached"]) == (expected["tokens"], expected["cached"])
        if turn:
            assert sum(computed) < 40 * 9 + 40     # the new turn's tokens and the rounds, never the whole history
        history = history + out["tokens"] + prompt(30 + turn, 20)


def drafts_as_uninterrupted(monkeypatch, tmp_path, tiny_model_dir, make, tier):
    """A two-turn conversation with the drafter `make(**settings)` builds: once kept on the device, once with the
    first turn restored from the host tier (device cache off) or from disk after a restart. The restored second turn
    gives the same output and, from its first decode step, the same proposals, its drafter's blocks hit in the tier.
    Returns the engine that restored."""
    first_turn = prompt(40, 150)
    (answer,) = run(engine_for(tiny_model_dir, None), [first_turn], GREEDY)
    second_turn = first_turn + answer["tokens"] + prompt(41, 30)
    kept = make()
    run(kept, [first_turn], GREEDY)
    expected = record_drafts(monkeypatch, kept)
    (uninterrupted,) = run(kept, [second_turn], GREEDY)
    settings = dict(kv_disk_dir=str(tmp_path), prefix_cache=tier == "disk", kv_host_gib=0.05 if tier == "host" else 0,
                    kv_disk=tier == "disk")
    engine = make(**settings)
    run(engine, [first_turn], GREEDY)     # stepping until nothing is unfinished waits for its saves too
    if tier == "disk":
        engine.shutdown()
        engine = make(**settings)
    drafts = record_drafts(monkeypatch, engine)
    (restored,) = run(engine, [second_turn], GREEDY)
    assert restored["tokens"] == uninterrupted["tokens"]
    assert engine.drafter.stats()["tiers"][tier]["hit_blocks"] >= len(first_turn) // BS - 1
    assert drafts == expected and drafts[0][0] == len(second_turn) + 1     # from its first decode step
    return engine


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_restored_conversation_drafts_what_the_uninterrupted_one_does(monkeypatch, tmp_path, tiny_model_dir,
                                                                         other_draft_dir, tier):
    """The draft model's blocks of the first turn restored from the host tier (device cache off) or from disk after a
    restart: the second turn's proposals are the ones an engine that kept everything on the device makes."""
    drafts_as_uninterrupted(monkeypatch, tmp_path, tiny_model_dir,
                            lambda **kw: drafting(tiny_model_dir, other_draft_dir, **kw), tier).shutdown()


def test_cancel_while_drafting_frees_both_pools(tiny_model_dir, other_draft_dir):
    engine = drafting(tiny_model_dir, other_draft_dir)
    run(engine, [prompt(7, 100), prompt(8, 90)], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
        abort_after=6)
    for pool in (engine.pool, engine.drafter.pool):
        assert pool.num_free_blocks == pool.num_blocks
    assert not engine.drafter.shadows and counts(engine)[1] > 0


def test_a_preempted_sequences_draft_gives_its_blocks_back_too(monkeypatch, plain, tiny_model_dir,
                                                                other_draft_dir):
    """In pools small enough that the target preempts sequences, each preempted one's draft blocks are given back
    with its own, so the draft pool has room for the sequences that run meanwhile; the output is unchanged, and
    the sequences that return propose again."""
    small = drafting(tiny_model_dir, other_draft_dir, kv_pool_tokens=12 * BS)
    released = []
    preempted = small.drafter.preempted

    def spy(seq):
        shadow = small.drafter.shadows[seq.request_id]
        held = [b for b in shadow.kv.block_table if b >= 0] if shadow.status.name == "RUNNING" else []
        preempted(seq)
        released.append(held and not shadow.kv.block_table)
    monkeypatch.setattr(small.drafter, "preempted", spy)
    prompts = [prompt(i, 48 + 10 * i) for i in range(5)]
    drafts = record_drafts(monkeypatch, small)
    assert [o["tokens"] for o in run(small, prompts, GREEDY)] == [o["tokens"] for o in run(plain, prompts, GREEDY)]
    assert any(released), "a running shadow was preempted and gave its blocks back"
    assert counts(small)[0] > 0 and drafts
    for pool in (small.pool, small.drafter.pool):
        assert pool.num_free_blocks == pool.num_blocks


BOUNDED = dict(kv_resident_tokens=8 * BS, kv_reselect_every=4, max_batched_tokens=64, kv_host_gib=1)


def bounded_drafter_keeps_its_window(monkeypatch, tiny_model_dir, make):
    """Under bounded residency (8 blocks of 16 for a 600-token prompt) the drafter `make(**settings)` builds is
    bounded too: its pool pages out to the host tier as the prompt goes by, holds at most the budget's blocks per
    sequence (by recency: its sink, tail and latest), and proposes from there; the blocks it seals past where its
    K/V came from a window are keyed in its bounded namespace; the output is the one without speculation, and both
    pools end empty. Returns the engine and its (accepted, proposed) tokens."""
    ids = [(13 * i + 5) % 900 + 20 for i in range(600)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (off,) = run(engine_for(tiny_model_dir, None, **BOUNDED), [ids], params)
    engine = make(**BOUNDED)
    namespaces = []
    namespace_for = engine.drafter.kv.pager.namespace_for
    monkeypatch.setattr(engine.drafter.kv.pager, "namespace_for", lambda state, block: (
        namespaces.append(namespace_for(state, block)), namespaces[-1])[1])
    (on,) = run(engine, [ids], params)
    assert on["tokens"] == off["tokens"]
    accepted, proposed = counts(engine)
    assert 0 < proposed and accepted <= proposed
    pager = engine.drafter.kv.pager
    assert pager.stats["page_outs"] > 0 and pager.stats["max_resident_blocks"] <= 8
    assert pager.bounded_namespace not in (engine.pager.bounded_namespace, engine.drafter.pool.namespace)
    assert {pager.bounded_namespace, engine.drafter.pool.namespace} == set(namespaces)     # exact, then bounded
    for pool in (engine.pool, engine.drafter.pool):
        assert pool.num_free_blocks == pool.num_blocks
    return engine, (accepted, proposed)


def bounded_drafts_as_uninterrupted(monkeypatch, tmp_path, tiny_model_dir, make, tier):
    """A bounded two-turn conversation whose first turn comes back from the host tier (device cache off) or from disk
    after a restart: the drafter's pager state travels in its own manifest beside the model's, its resident blocks
    load from the tier, and it proposes from the second turn's first decode step what the uninterrupted conversation
    proposes there, and the model answers as it did. Returns the engine that restored."""
    first_turn = prompt(40, 400)
    (answer,) = run(engine_for(tiny_model_dir, None, **BOUNDED), [first_turn], GREEDY)
    second_turn = first_turn + answer["tokens"] + prompt(41, 30)
    kept = make(**BOUNDED)
    run(kept, [first_turn], GREEDY)
    expected = record_drafts(monkeypatch, kept)
    (uninterrupted,) = run(kept, [second_turn], GREEDY)
    settings = BOUNDED | dict(kv_disk_dir=str(tmp_path), prefix_cache=False, kv_disk=tier == "disk")
    engine = make(**settings)
    run(engine, [first_turn], GREEDY)     # stepping until nothing is unfinished waits for its saves too
    if tier == "disk":
        engine.shutdown()
        engine = make(**settings)
    restored_windows = []
    pager = engine.drafter.kv.pager
    restore = pager.restore
    monkeypatch.setattr(pager, "restore", lambda state, manifest: (restored_windows.append(manifest.resident),
                                                                   restore(state, manifest)))
    drafts = record_drafts(monkeypatch, engine)
    (restored,) = run(engine, [second_turn], GREEDY)
    assert restored["tokens"] == uninterrupted["tokens"]
    assert restored_windows and not all(restored_windows[0])      # a window: some blocks stayed paged out
    assert engine.drafter.stats()["tiers"][tier]["hit_blocks"] > 0
    assert drafts[0] == expected[0] and drafts[0][0] == len(second_turn) + 1     # from its first decode step
    return engine


def test_a_draft_model_under_bounded_residency_keeps_its_window(monkeypatch, tiny_model_dir):
    _, (accepted, _) = bounded_drafter_keeps_its_window(
        monkeypatch, tiny_model_dir, lambda **kw: drafting(tiny_model_dir, tiny_model_dir, **kw))
    assert accepted > 0       # the model drafting for itself over its window


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_bounded_conversation_restores_its_drafts_window(monkeypatch, tmp_path, tiny_model_dir, tier):
    """(Later proposals may differ: whether a shadow computes the turn's last tokens as a prompt chunk or as decode
    rows over its window depends on when its load lands.)"""
    bounded_drafts_as_uninterrupted(monkeypatch, tmp_path, tiny_model_dir,
                                    lambda **kw: drafting(tiny_model_dir, tiny_model_dir, **kw), tier).shutdown()


def test_draft_settings_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="go together"):
        Config(speculative="draft")
    with pytest.raises(ConfigError, match="go together"):
        Config(speculative="ngram", draft_model=tiny_model_dir)
    with pytest.raises(ConfigError, match="does not exist"):
        Config(speculative="draft", draft_model=str(tmp_path / "missing"))
    assert Speculator("draft", 4).plan(Speculator("draft", 4).new_state(), room=0) == 0


# --- the bundled model, through ggml's decode graphs --------------------------------------------------------------

@pytest.mark.integration
def test_the_bundled_model_drafting_for_itself_has_every_proposal_accepted():
    """The bundled model (quantized, ggml's graphs) as its own draft model: a draft decode row scores as the
    target's verify row does, so every greedy proposal is accepted, and the output is the one without speculation."""
    from kvtier.models.loader import BUNDLED_MODEL
    settings = dict(kv_host_gib=0, kv_disk=False, kv_pool_tokens=4096)
    plain = LLMEngine(Config(**settings))
    engine = LLMEngine(Config(**settings, speculative="draft", draft_model=BUNDLED_MODEL, num_speculative_tokens=4))
    engine.speculator.draft_cost = lambda k: 0.0
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two "
                                                                  "numbers, then explain it."}])
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    (expected,) = run(plain, [prompt], params)
    (out,) = run(engine, [prompt], params)
    assert out["tokens"] == expected["tokens"]
    accepted, proposed = counts(engine)
    assert proposed >= 30 and accepted == proposed
    assert engine.speculator.stats()["verify_steps"] <= 48 // 4 + 2


@pytest.mark.integration
def test_the_server_speculates_with_a_draft_model(tmp_path):
    """`kvtier serve --speculative draft --draft-model` through the openai client: the answer the engine gives
    without speculation, the draft model's counters in /metrics, and its blocks in the disk tier beside the
    target's, under their own namespace."""
    from test_speculation import served_and_plain

    from kvtier.kv.tiers import inventory
    from kvtier.models.loader import BUNDLED_MODEL
    messages = [{"role": "user", "content": "List the first ten prime numbers, one per line."}]
    args = ["--speculative", "draft", "--draft-model", BUNDLED_MODEL, "--kv-disk-dir", str(tmp_path / "kv"),
            "--kv-host-gib", "0"]
    answer, metrics, engine, plain = served_and_plain(args, messages, tmp_path / "server.log")
    assert answer.choices[0].message.content.strip() == engine.tokenizer.decode(plain["tokens"]).strip()
    assert metrics['kvtier_spec_proposed_tokens_total{method="draft"}'] > 0
    assert len(inventory.survey(str(tmp_path / "kv"))["namespaces"]) == 2      # the target's and the draft's
