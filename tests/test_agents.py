"""The coding agents people run, installed from npm by `make test` (pinned in the Makefile), each driving a
three-turn session against a real `kvtier serve` (kvtier/bench/agents.py drives them; its benchmark reports the
same sessions).

The model is a tiny random-weight Llama with a 64K context (the agents' own prompts are 7-18K tokens); its replies
are scripted by constrained decoding: each turn, a call of the agent's shell tool, which the agent really runs, then
a short answer. Every turn must pass with no 4xx, run its tool, and every request after the first turn must find at
least 90% of its prompt in the cache."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess

import pytest
from conftest import ROOT, kvtier_server, scrape, tiny_llama

from kvtier.bench.agents import (
    AGENTS_BIN,
    API_KEY,
    CACHED_SHARE_TARGET,
    SHELL_TOOLS,
    Agent,
    Session,
    script,
)
from kvtier.models.gguf_file import GGUFFile
from kvtier.models.loader import BUNDLED_MODEL

pytestmark = pytest.mark.skipif(not AGENTS_BIN.is_dir(),
                                reason="the coding agents are not installed (make test installs them with npm)")


@pytest.fixture(scope="module")
def long_context_model(make_tiny_model, bundled_tokenizer) -> str:
    return make_tiny_model(tiny_llama(bundled_tokenizer.vocab_size, context=65536))


@pytest.fixture(scope="module")
def script_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(script()))
    return str(path)


@pytest.fixture(scope="module")
def server(long_context_model, script_path, tmp_path_factory):
    """(url, log path): the tiny long-context model, answering to any model name (Claude Code's background
    model has a name of its own)."""
    tmp = tmp_path_factory.mktemp("agents-server")
    args = ["--model", long_context_model, "--any-model-name", "--kv-pool-tokens", "131072",
            "--kv-disk-dir", str(tmp / "kv"), "--api-key", API_KEY]
    with kvtier_server(args, tmp / "server.log", env={"KVTIER_TEST_SCRIPT": script_path}) as url:
        yield url, tmp / "server.log"


def client_errors(url: str) -> dict[str, float]:
    import httpx
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        return {k: v for k, v in scrape(http).items()
                if k.startswith("kvtier_request_errors_total") and 'status="4' in k}


REPLY_ROOM = 64     # tokens left for a reply (the scripted ones take 38)


@pytest.mark.parametrize("name", list(SHELL_TOOLS))
def test_agent_session(name, server, tmp_path):
    """Three turns, each with a tool round trip (Session.run checks the answer and the tool's mark), no 4xx;
    turns after the first reuse >= 90% of each prompt; only opencode's prompts fit the bundled model's context."""
    url, log_path = server
    errors_before = client_errors(url)
    session = Session(Agent(name, url, tmp_path), log_path).run()
    assert client_errors(url) == errors_before, f"{name} got 4xx answers: see {log_path}"
    assert all(len(turn) >= 2 for turn in session.turns), session.turns     # a call and an answer per turn
    shares = session.later_shares()
    assert min(shares) >= CACHED_SHARE_TARGET, f"{name}: cached shares of the later turns' prompts {shares}"
    # the tiny model has the bundled tokenizer and chat template: of the four, only opencode's three turns fit the
    # bundled SmolLM2's context with room for a reply (README; `kvtier bench agents --model` runs them on it)
    longest, context = max(prompt for turn in session.turns for prompt, _ in turn), bundled_context()
    assert (longest + REPLY_ROOM <= context) == (name == "opencode"), f"{name}: {longest} of {context} tokens"


@functools.cache
def bundled_context() -> int:
    return GGUFFile(BUNDLED_MODEL).fields["llama.context_length"]


def test_agents_are_the_pinned_versions(tmp_path):
    versions = {}
    for name in ("claude", "codex", "opencode", "qwen"):
        proc = subprocess.run([os.path.join(AGENTS_BIN, name), "--version"], capture_output=True, text=True,
                              timeout=60, env={"PATH": f"{AGENTS_BIN}:{os.environ['PATH']}", "HOME": str(tmp_path)})
        versions[name] = proc.stdout.strip()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    for name, package in (("claude", "claude-code"), ("codex", "codex"), ("opencode", "opencode-ai"),
                          ("qwen", "qwen-code")):
        pinned = re.search(rf"{package}@([\d.]+)", makefile).group(1)
        assert pinned in versions[name], (name, versions[name], pinned)
    assert shutil.which("node", path=AGENTS_BIN)
