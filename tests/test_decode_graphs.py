"""Decode steps from a graph's fixed buffers equal eager ones: ragged contexts across block boundaries, batches
padded to their bucket and shrinking as requests finish, a request admitted mid-way (its prefill step runs eagerly).
On CPU the buffers run uncaptured, attention through Triton's interpreter; on CUDA (gpu marker) captured graphs
replay them."""
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is installed by the test command")
from kvtier.config import Config  # noqa: E402
from kvtier.engine.engine import LLMEngine  # noqa: E402
from kvtier.engine.graphs import DecodeGraphs  # noqa: E402
from kvtier.engine.sampling_params import SamplingParams  # noqa: E402

DEVICE = os.environ.get("KVTIER_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("on CPU the decode kernel runs only in Triton's interpreter (TRITON_INTERPRET=1)",
                allow_module_level=True)

# (prompt length, max tokens): contexts ending inside, at and across 64-token blocks, finishing at different steps
WORK = [(3, 9), (63, 6), (64, 12), (130, 3), (200, 8)]
LATE = (90, 5)      # added after the third step, beside running decodes


def engine(model_dir: str, device: str, enforce_eager: bool, speculative: str | None = None) -> LLMEngine:
    """No pacing: it would spread the late prompt over steps by their measured times, and so vary how many steps
    decode only."""
    return LLMEngine(Config(model=model_dir, device=device, dtype="float32", kv_pool_tokens=64 * 64,
                            max_num_seqs=6, kv_host_gib=0, kv_disk=False, enforce_eager=enforce_eager,
                            speculative=speculative, max_itl_ratio=0))


def generate(eng: LLMEngine) -> dict[str, tuple[list[int], list[float]]]:
    """Every request's greedy tokens and their logprobs."""
    gen = torch.Generator().manual_seed(3)

    def add(i, length, max_tokens):
        prompt = torch.randint(100, 40000, (length,), generator=gen).tolist()
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                         logprobs=0))
    for i, work in enumerate(WORK):
        add(i, *work)
    results, steps = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            tokens, logprobs = results.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs]
        steps += 1
        if steps == 3:
            add(len(WORK), *LATE)
    return results


def assert_same(graphed, eager):
    assert graphed.keys() == eager.keys() and len(eager) == len(WORK) + 1
    for request_id, (tokens, logprobs) in eager.items():
        assert graphed[request_id][0] == tokens, request_id
        assert graphed[request_id][1] == pytest.approx(logprobs, abs=1e-4), request_id


def test_decode_from_graph_buffers_equals_eager(tiny_model_dir):
    eager = engine(tiny_model_dir, DEVICE, enforce_eager=True)
    graphed = engine(tiny_model_dir, DEVICE, enforce_eager=True)
    graphed.runner.graphs = DecodeGraphs(graphed.model, graphed.pool, 6, graphed.max_model_len, capture=False)
    assert graphed.runner.graphs.buckets == [1, 2, 4, 6]
    assert_same(generate(graphed), generate(eager))
    assert graphed.runner.graphs.steps >= 8      # most steps decode only: 5 sequences, then 6, shrinking to 1


@pytest.mark.gpu
def test_captured_decode_graphs_equal_eager(tiny_model_dir):
    eager = engine(tiny_model_dir, "cuda", enforce_eager=True)
    graphed = engine(tiny_model_dir, "cuda", enforce_eager=False)
    assert sorted({bucket for bucket, _ in graphed.runner.graphs.graphs}) == [1, 2, 4, 6]   # by (bucket, splits)
    assert_same(generate(graphed), generate(eager))
    assert graphed.runner.graphs.steps >= 8


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["buffers", "captured"])
def test_a_graph_splits_a_long_context_and_not_a_short_one(monkeypatch, tiny_model_dir, capture):
    """A step replays the graph split for its longest context's length bucket: one part for a 100-token context,
    two for a 600-token one (on CPU a 16-multiprocessor GPU stands in), both equal to eager decode."""
    from conftest import run_greedy
    device = "cuda" if capture else DEVICE
    eager = engine(tiny_model_dir, device, enforce_eager=True)
    graphed = engine(tiny_model_dir, device, enforce_eager=not capture)
    if not capture:
        graphed.runner.graphs = DecodeGraphs(graphed.model, graphed.pool, 6, graphed.max_model_len, capture=False,
                                             num_multiprocessors=None if device == "cuda" else 16)
    graphs = graphed.runner.graphs
    assert graphs.lengths == [512, 1024, 2048]
    if device == "cpu":
        assert [graphs.split_count(n) for n in (100, 512, 600, 2000)] == [1, 1, 2, 4]
    used = []
    if capture:      # which captured graph each step replays
        for key, graph in graphs.graphs.items():
            monkeypatch.setattr(graph, "replay", lambda key=key, replay=graph.replay: (used.append(key[1]), replay())[1])
    else:
        forward = graphs._forward
        monkeypatch.setattr(graphs, "_forward", lambda b, splits: (used.append(splits), forward(b, splits))[1])
    for length in (100, 600):
        prompt = [(31 * i) % 900 + 20 for i in range(length)]
        want, got = run_greedy(eager, prompt, max_tokens=4), run_greedy(graphed, prompt, max_tokens=4)
        assert got.tokens == want.tokens
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    splits = {graphs.split_count(103), graphs.split_count(603)}
    assert set(used) == splits and len(used) == 6          # 3 decode steps of each; on CPU {1, 2}
    assert len(splits) == 2, "a 600-token context splits where a 100-token one does not"


@pytest.mark.parametrize("capture", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["buffers", "captured"])
def test_verify_steps_replay_the_graphs(monkeypatch, tiny_model_dir, capture):
    """A verify step (a sequence's last token and its draft) runs from the graphs, each row a decode of its own:
    greedy output as without speculation, with an oracle drafter that is wrong every few tokens."""
    from test_speculation import oracle, run
    device = "cuda" if capture else DEVICE
    plain = engine(tiny_model_dir, device, enforce_eager=True)
    speculating = engine(tiny_model_dir, device, enforce_eager=capture is False, speculative="ngram")
    if not capture:
        speculating.runner.graphs = DecodeGraphs(speculating.model, speculating.pool, 6, speculating.max_model_len,
                                                 capture=False, rows_per_seq=9)
    graphs = speculating.runner.graphs
    assert graphs.buckets == [1, 2, 4, 8, 16, 24, 32, 48, 54]       # up to 6 sequences of 1 + 8 rows
    rows_run, replay = [], graphs.run
    monkeypatch.setattr(graphs, "run", lambda *inputs: (rows_run.append(inputs[-1]), replay(*inputs))[1])
    prompts = [[(13 * i + 5 * j) % 900 + 20 for j in range(30 + 40 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    off = run(plain, prompts, params)
    oracle(monkeypatch, speculating, prompts, [o["tokens"] for o in off])
    on = run(speculating, prompts, params)
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    for a, b in zip(on, off):
        assert [lp.logprob for lp in a["logprobs"]] == pytest.approx([lp.logprob for lp in b["logprobs"]], abs=1e-4)
    assert any(max(rows) > 1 for rows in rows_run), "verify steps ran from the graphs"
