"""The coding agents people run, installed from npm by `make test` (pinned in the Makefile), each driving a
three-turn session against a real `kvtier serve`, headless, in an empty directory: Claude Code (Anthropic
Messages), Codex CLI (Responses), opencode and Qwen Code (chat completions).

The model is a tiny random-weight Llama with a 64K context (the agents' own prompts are 7-20K tokens). A
random model writes neither tool calls nor an end, so its replies are scripted by constrained decoding
($KVTIER_TEST_SCRIPT): the first reply of each turn calls the agent's own shell tool, which the agent really
runs, and the reply after the tool's result is a short answer. Every turn must pass with no 4xx, run its
tool, and every request after the first turn must find at least 90% of its prompt in the cache."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from conftest import ROOT, kvtier_server, scrape, tiny_llama

AGENTS_BIN = os.path.join(ROOT, ".agents", "node_modules", ".bin")
TURNS = ("Run the command.", "Run it again.", "Once more, please.")
MARK = "echo ran >> tool-ran.txt"       # the command every scripted call runs: one line per turn
ANSWER = "Done, the command ran."
# each agent's shell tool, and the arguments its schema wants
SHELL_TOOLS = {"claude": ("Bash", {"command": MARK, "description": "Mark the turn"}),
               "codex": ("exec_command", {"cmd": MARK}),
               "opencode": ("bash", {"command": MARK, "description": "Mark the turn"}),
               "qwen": ("run_shell_command", {"command": MARK, "description": "Mark the turn"})}
TURN_TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(not os.path.isdir(AGENTS_BIN),
                                reason="the coding agents are not installed (make test installs them with npm)")


def script() -> list[dict]:
    rules = []
    for name, arguments in SHELL_TOOLS.values():
        call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
        rules.append({"tool": name, "reply": f"<tool_call>\n{call}\n</tool_call>"})
    return rules + [{"reply": ANSWER}]


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
            "--kv-disk-dir", str(tmp / "kv"), "--api-key", "sk-agents"]
    with kvtier_server(args, tmp / "server.log", env={"KVTIER_TEST_SCRIPT": script_path}) as url:
        yield url, tmp / "server.log"


class Agent:
    """One agent's headless runs: its own home and working directory, so its sessions are its own."""

    def __init__(self, name: str, url: str, tmp):
        self.name, self.url = name, url
        self.home, self.workdir = tmp / "home", tmp / "work"
        self.home.mkdir()
        self.workdir.mkdir()
        (self.workdir / "notes.txt").write_text("A file for the agent to find.\n")
        self.env = {"PATH": f"{AGENTS_BIN}:{os.environ['PATH']}", "HOME": str(self.home), "LANG": "C.UTF-8",
                    "NO_COLOR": "1", "TERM": "dumb"}
        getattr(self, f"_setup_{name}")()

    def run(self, turn: int, prompt: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(self._command(turn, prompt), cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=TURN_TIMEOUT_S)
        assert proc.returncode == 0, f"{self.name} turn {turn + 1} exited {proc.returncode}:\n" \
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    def _setup_claude(self):
        self.env.update(ANTHROPIC_BASE_URL=self.url, ANTHROPIC_API_KEY="sk-agents", ANTHROPIC_MODEL="local-model",
                        ANTHROPIC_DEFAULT_HAIKU_MODEL="local-small", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                        DISABLE_AUTOUPDATER="1", IS_SANDBOX="1")     # IS_SANDBOX: skipping permissions as root

    def _setup_codex(self):
        codex_home = self.home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(url=self.url))
        self.env.update(CODEX_HOME=str(codex_home), KVTIER_API_KEY="sk-agents")

    def _setup_opencode(self):
        (self.workdir / "opencode.json").write_text(json.dumps(opencode_config(self.url)))
        self.env.update(OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1")

    def _setup_qwen(self):
        self.env.update(OPENAI_BASE_URL=f"{self.url}/v1", OPENAI_API_KEY="sk-agents", OPENAI_MODEL="local-model",
                        QWEN_CODE_SUPPRESS_YOLO_WARNING="1")

    def _command(self, turn: int, prompt: str) -> list[str]:
        bin_ = os.path.join(AGENTS_BIN, self.name)
        again = turn > 0
        if self.name == "claude":
            return [bin_, "-p", prompt, "--dangerously-skip-permissions", *(["--continue"] if again else [])]
        if self.name == "codex":
            return [bin_, "exec", *(["resume", "--last"] if again else []), "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox", prompt]
        if self.name == "opencode":
            return [bin_, "run", *(["--continue"] if again else []), prompt]
        return [bin_, "-p", prompt, "--yolo", *(["--continue"] if again else [])]


CODEX_CONFIG = """model = "local-model"
model_provider = "kvtier"

[model_providers.kvtier]
name = "kvtier"
base_url = "{url}/v1"
env_key = "KVTIER_API_KEY"
wire_api = "responses"
"""


def opencode_config(url: str, api_key: str = "sk-agents") -> dict:
    return {"$schema": "https://opencode.ai/config.json", "model": "kvtier/local-model",
            "provider": {"kvtier": {"npm": "@ai-sdk/openai-compatible", "name": "kvtier",
                                    "options": {"baseURL": f"{url}/v1", "apiKey": api_key},
                                    "models": {"local-model": {"name": "local-model"}}}}}


REQUEST_LINE = re.compile(r"request \S+ \w+: (\d+) prompt tokens \((?:none cached, )?.*?(\d+) computed\)")


def finished_requests(log_text: str) -> list[tuple[int, int]]:
    """(prompt tokens, of them cached) of each finished request, in order, from the server's log."""
    return [(int(prompt), int(prompt) - int(computed)) for prompt, computed in REQUEST_LINE.findall(log_text)]


def client_errors(url: str) -> dict[str, float]:
    import httpx
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-agents"}) as http:
        return {k: v for k, v in scrape(http).items()
                if k.startswith("kvtier_request_errors_total") and 'status="4' in k}


@pytest.mark.parametrize("name", list(SHELL_TOOLS))
def test_agent_session(name, server, tmp_path):
    """Three turns, each with a tool round trip, no 4xx; turns after the first reuse >= 90% of each prompt."""
    url, log_path = server
    agent = Agent(name, url, tmp_path)
    errors_before = client_errors(url)
    requests_before = len(finished_requests(log_path.read_text()))
    turn_starts = []
    for turn, prompt in enumerate(TURNS):
        turn_starts.append(len(finished_requests(log_path.read_text())))
        proc = agent.run(turn, prompt)
        assert ANSWER in proc.stdout, f"{name} turn {turn + 1} did not print the answer:\n{proc.stdout[-2000:]}"
        assert (agent.workdir / "tool-ran.txt").read_text().splitlines() == ["ran"] * (turn + 1), \
            f"{name} turn {turn + 1} did not run its tool"
    assert client_errors(url) == errors_before, f"{name} got 4xx answers: see {log_path}"
    requests = finished_requests(log_path.read_text())
    assert len(requests) - requests_before >= 2 * len(TURNS)       # a call and an answer per turn
    later = requests[turn_starts[1]:]
    shares = [cached / prompt for prompt, cached in later]
    assert min(shares) >= 0.9, f"{name}: cached shares of the later turns' prompts {shares}"


def test_opencode_on_the_bundled_model(tmp_path):
    """The bundled SmolLM2's 8K context holds opencode's prompt (about 7.7K tokens) with room for three turns;
    Claude Code (about 20K), Qwen Code (about 18K) and Codex (about 9K) need a longer context (README)."""
    script_path = tmp_path / "script.json"
    script_path.write_text(json.dumps(script()))
    args = ["--max-model-len", "8192", "--kv-pool-tokens", "16384", "--kv-disk-dir", str(tmp_path / "kv"),
            "--api-key", "sk-agents"]
    with kvtier_server(args, tmp_path / "server.log", env={"KVTIER_TEST_SCRIPT": str(script_path)}) as url:
        agent_dir = tmp_path / "agent"
        agent_dir.mkdir()
        agent = Agent("opencode", url, agent_dir)
        (agent.workdir / "opencode.json").write_text(json.dumps(opencode_config(url)).replace(
            "local-model", _bundled_name(url)))
        for turn, prompt in enumerate(TURNS):
            assert ANSWER in agent.run(turn, prompt).stdout
        assert (agent.workdir / "tool-ran.txt").read_text().splitlines() == ["ran"] * len(TURNS)
        assert client_errors(url) == {}


def _bundled_name(url: str) -> str:
    import httpx
    return httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-agents"}).json()["data"][0]["id"]


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
