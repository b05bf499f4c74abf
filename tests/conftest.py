"""Shared fixtures: the bundled tokenizer and tiny random-weight Hugging Face models."""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import os
import shutil
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network, before transformers reads it
# the default disk tier lives under the user's cache directory: give the test session its own, removed at its end
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kvtier-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# KVTIER_DEVICE=cuda runs the whole suite on the GPU (Config's default device), in float32 so that it compares with
# the same references; elsewhere Triton kernels run in Triton's interpreter, which must be chosen before it is imported
if os.environ.get("KVTIER_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("KVTIER_DTYPE", "float32")
    # pytest-xdist's workers share the GPU: each engine keeps to its part of the device, three a worker (a test's
    # engine, a module's, a session's server)
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        share = 0.7 / (3 * int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        os.environ.setdefault("KVTIER_GPU_MEMORY_UTILIZATION", f"{share:.3f}")
    # each engine pins its host tier (4 GiB by default) in RAM the workers share: 1 GiB holds 20K tokens of the
    # bundled model's K/V, more than any test pages out
    os.environ.setdefault("KVTIER_KV_HOST_GIB", "1")
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvtier.bench.server import ServerFailed, running_server
from kvtier.models.loader import BUNDLED_MODEL
from kvtier.models.tokenizer import Tokenizer


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need CUDA, and Triton's kernels compiled: skipped (and reported as skipped) without them. On a
    GPU, Triton's interpreter (TRITON_INTERPRET=1, which the suite sets unless KVTIER_DEVICE=cuda) copies each tensor
    to the host and back, and a gpu test would pass without compiling a kernel, or fail inside a graph capture."""
    if not torch.cuda.is_available():
        reason = "needs CUDA"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "Triton runs in its interpreter (TRITON_INTERPRET=1): KVTIER_DEVICE=cuda make test, that unset"
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """torch's thread count back after each test that set it (an engine's `num_threads`, a benchmark's `--threads`):
    a later test in the same worker would otherwise run its in-process engine on another count than the servers it
    starts (they take OMP_NUM_THREADS), and torch's products round by their thread count on some CPUs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def two_threads():
    """torch (and so ggml's ops planned from torch's count) on two threads for the test (torch_threads_restored puts
    the count back)."""
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def bundled_tokenizer() -> Tokenizer:
    return Tokenizer.load(BUNDLED_MODEL)


@pytest.fixture(scope="session")
def bundled_transformers():
    """transformers' own model of the bundled GGUF (it dequantizes and un-permutes the file itself), float32, eval:
    the reference kvtier's loader and engine are held to (loading it takes ~12 s on one core: once a session)."""
    import gguf
    # transformers parses the file's metadata twice (config, then weights) and builds gguf's tensor-name map once
    # per submodule, 18 of the load's 27 s on one core: each once here (both pure: the same model either way)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(BUNDLED_MODEL),
                                                     gguf_file=os.path.basename(BUNDLED_MODEL), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, bundled_tokenizer):
    """make_tiny_model(hf_config, seed=0, tokenizer=None) -> path of a directory holding a random-weight model
    built from hf_config (a transformers config) and a Hugging Face tokenizer (the bundled one by default)."""
    def make(hf_config, seed: int = 0, tokenizer=None) -> str:
        path = tmp_path_factory.mktemp(f"tiny-{hf_config.model_type}")
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config)
        model.save_pretrained(path)
        (tokenizer or bundled_tokenizer.hf).save_pretrained(path)
        return str(path)
    return make


@pytest.fixture(scope="session")
def qwen3_tokenizer(bundled_tokenizer):
    """The bundled tokenizer (ChatML, as Qwen's) with Qwen3's think and tool-call tokens and Qwen3's real chat
    template (tests/data/qwen3_chat_template.jinja)."""
    import copy
    hf = copy.deepcopy(bundled_tokenizer.hf)
    hf.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    with open(os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.jinja")) as f:
        hf.chat_template = f.read()
    return hf


@pytest.fixture(scope="session")
def tiny_qwen3_dir(make_tiny_model, qwen3_tokenizer) -> str:
    """A tiny random Qwen3 (hidden 64, 2 layers) with Qwen3's chat template and think tokens."""
    from transformers import Qwen3Config
    return make_tiny_model(Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=len(qwen3_tokenizer), max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), tokenizer=qwen3_tokenizer)


def ggml_quantized(qtype, out_features: int, in_features: int, seed: int = 0,
                   off_centre: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight whose rows have different scales (and means spread by off_centre: where a block's minimum
    matters, as Q4_1's), quantized by ggml to qtype: its blocks (uint8) and the gguf package's dequantization of them
    (float32)."""
    import numpy as np
    from gguf.quants import dequantize

    from kvtier.models import ggml
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * torch.rand(out_features, 1, generator=gen)
    weight += off_centre * torch.randn(out_features, 1, generator=gen)
    blocks = ggml.quantize(weight, int(qtype))
    weights = dequantize(blocks.numpy(), qtype).reshape(out_features, in_features).astype(np.float32)
    return blocks, torch.from_numpy(weights)


def fill_random(pool, seed: int) -> None:
    """The pool's K and V, every slot, seeded random values."""
    generator = torch.Generator().manual_seed(seed)
    for cache in pool.caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))


def tiny_llama(vocab_size: int, context: int = 2048) -> LlamaConfig:
    """A tiny Llama's config (hidden 64, 2 layers, 4 heads, 2 KV heads, untied head)."""
    return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=context,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model, bundled_tokenizer) -> str:
    """A tiny Llama with fixed random weights."""
    return make_tiny_model(tiny_llama(bundled_tokenizer.vocab_size))


class GreedyRun:
    """What run_greedy saw; unpacks as (tokens, logprobs, cached tokens)."""

    def __init__(self, tokens, logprobs, cached, first_logits):
        self.tokens, self.logprobs, self.cached, self.first_logits = tokens, logprobs, cached, first_logits

    def __iter__(self):
        return iter((self.tokens, self.logprobs, self.cached))


def run_greedy(engine, prompt, **kw) -> GreedyRun:
    """One request through a synchronous engine. Stepping until nothing is unfinished also waits for
    background saves to land. first_logits: the raw logits the first output token was sampled from."""
    from kvtier.engine.sampling_params import SamplingParams
    params = SamplingParams(**{"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 20, **kw})
    engine.add_request("r", prompt, params)
    tokens, logprobs, cached, step_logits = [], [], None, []
    run = engine.runner.run

    def keep_logits(batch, capture=None):
        logits, queries = run(batch, capture)
        step_logits.append(logits[0][-1].clone())
        return logits, queries

    engine.runner.run = keep_logits
    first = None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and not tokens:
                    first = step_logits[-1]
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
                cached = out.num_cached_tokens
    finally:
        del engine.runner.run
    return GreedyRun(tokens, logprobs, cached, first)


def max_logit_diff(a: GreedyRun, b: GreedyRun) -> float:
    return (a.first_logits - b.first_logits).abs().max().item()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def kvtier_server(args: list[str], log_path, env: dict[str, str] | None = None, on_start=None):
    """A real `kvtier serve` subprocess on a free port (bundled model unless --model is given); yields its URL.
    env: more environment variables; on_start(proc) is called once it is healthy."""
    try:
        with running_server(args, log_path, env, on_start) as url:
            yield url
    except ServerFailed as e:
        pytest.fail(str(e))


def scrape(http) -> dict[str, float]:
    """The /metrics samples, by name with labels, e.g. 'kvtier_requests_total{endpoint="/v1/models",status="200"}'."""
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


IDLE_GAUGES = ("kvtier_requests_running", "kvtier_requests_waiting", "kvtier_requests_loading",
               "kvtier_kv_pool_blocks_used", 'kvtier_kv_tier_pinned_bytes{tier="host"}', "kvtier_kv_host_reserved_bytes")


def sse_events(text: str) -> list[dict]:
    """The JSON events of a server-sent event stream, which must end with [DONE]."""
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def until_nothing_runs(engine, polls: int = 100) -> None:
    """Wait (at most polls x 20 ms) until an AsyncEngine runs no request: a cancelled one has been aborted."""
    for _ in range(polls):
        if engine.stats()["num_running"] == 0:
            return
        await asyncio.sleep(0.02)


def wait_until_idle(http, timeout=10.0) -> dict[str, float]:
    """The metrics once nothing runs, waits or loads and no device block or host pin is held (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(http)
        if all(m.get(name, 0) == 0 for name in IDLE_GAUGES) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


API_KEY = "sk-test"


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory):
    """One `kvtier serve` (bundled model, disk tier, API key API_KEY) shared by the agent-API tests:
    (url, path of its log)."""
    tmp = tmp_path_factory.mktemp("agent-server")
    # float32 weights: the agents' replies (whether a 135M model closes a tool call within its budget) stay the
    # ones these tests were written against, whatever the cache held when a request came (quantized weights'
    # decode rows round their activations to 8 bits, so a reply can change with what other tests left in the
    # cache); quantized weights serve most other server tests
    args = ["--kv-pool-tokens", "16384", "--max-model-len", "2048", "--kv-disk-dir", str(tmp / "kv"),
            "--api-key", API_KEY, "--quantize", "none"]
    with kvtier_server(args, tmp / "server.log") as url:
        yield url, tmp / "server.log"


@pytest.fixture(scope="session")
def agent_client(agent_server):
    """The official openai client on the agent server."""
    from openai import OpenAI
    return OpenAI(base_url=f"{agent_server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def agent_model(agent_client) -> str:
    return agent_client.models.list().data[0].id
