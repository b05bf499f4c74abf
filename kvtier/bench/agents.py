"""Agent sessions: the coding agents people run, each driving a three-turn session against a real `kvtier serve`,
headless, in an empty directory: Claude Code (Anthropic Messages), Codex CLI (Responses), opencode and Qwen Code
(chat completions). Installed from npm by `make .agents/.installed` (pinned in the Makefile).

A random-weight model writes neither tool calls nor an end, so the replies are scripted by constrained decoding
(the test-only $KVTIER_TEST_SCRIPT): the first reply of each turn calls the agent's own shell tool, which the agent
really runs, and the reply after the tool's result is a short answer. The requests are the agents' own. Per agent:
the prompt tokens each request sent, and the share of them the cache held in the turns after the first (target:
at least 90% of every such request's prompt), read from the server's log.

    python -m kvtier.bench.agents [--agents claude,codex,opencode,qwen] [--shape tiny-llama3 | --model M]
                                  [--max-model-len 65536] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from kvtier.bench.report import add_output_args, cpu_model, header, parse_command, publish, verdict
from kvtier.bench.server import ROOT, running_server
from kvtier.bench.shapes import add_model_args, resolve_model

SECTION = "## Agent sessions (cache reuse through real coding agents)"
AGENTS_BIN = ROOT / ".agents" / "node_modules" / ".bin"
TURNS = ("Run the command.", "Run it again.", "Once more, please.")
MARK = "echo ran >> tool-ran.txt"       # the command every scripted call runs: one line per turn
ANSWER = "Done, the command ran."
# each agent's shell tool, and the arguments its schema wants
SHELL_TOOLS = {"claude": ("Bash", {"command": MARK, "description": "Mark the turn"}),
               "codex": ("exec_command", {"cmd": MARK}),
               "opencode": ("bash", {"command": MARK, "description": "Mark the turn"}),
               "qwen": ("run_shell_command", {"command": MARK, "description": "Mark the turn"})}
API_KEY = "sk-agents"
TURN_TIMEOUT_S = 240
CACHED_SHARE_TARGET = 0.9


def script() -> list[dict]:
    """The $KVTIER_TEST_SCRIPT rules: call whichever agent's shell tool is offered, else answer."""
    rules = []
    for name, arguments in SHELL_TOOLS.values():
        call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
        rules.append({"tool": name, "reply": f"<tool_call>\n{call}\n</tool_call>"})
    return rules + [{"reply": ANSWER}]


class AgentFailed(RuntimeError):
    pass


class Agent:
    """One agent's headless runs: its own home and working directory under tmp, so its sessions are its own."""

    def __init__(self, name: str, url: str, tmp: Path, model: str = "local-model"):
        self.name, self.url, self.model = name, url, model
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
        if proc.returncode != 0:
            raise AgentFailed(f"{self.name} turn {turn + 1} exited {proc.returncode}:\n"
                              f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def tool_runs(self) -> int:
        marks = self.workdir / "tool-ran.txt"
        return len(marks.read_text().splitlines()) if marks.exists() else 0

    def _setup_claude(self):
        # a fixed model name: Claude Code writes it into its system prompt; IS_SANDBOX: skipping permissions as root
        self.env.update(ANTHROPIC_BASE_URL=self.url, ANTHROPIC_API_KEY=API_KEY, ANTHROPIC_MODEL=self.model,
                        ANTHROPIC_DEFAULT_HAIKU_MODEL="local-small", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                        DISABLE_AUTOUPDATER="1", IS_SANDBOX="1")

    def _setup_codex(self):
        codex_home = self.home / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(url=self.url, model=self.model))
        self.env.update(CODEX_HOME=str(codex_home), KVTIER_API_KEY=API_KEY)

    def _setup_opencode(self):
        (self.workdir / "opencode.json").write_text(json.dumps(opencode_config(self.url, self.model)))
        self.env.update(OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1")

    def _setup_qwen(self):
        self.env.update(OPENAI_BASE_URL=f"{self.url}/v1", OPENAI_API_KEY=API_KEY, OPENAI_MODEL=self.model,
                        QWEN_CODE_SUPPRESS_YOLO_WARNING="1")

    def _command(self, turn: int, prompt: str) -> list[str]:
        bin_ = str(AGENTS_BIN / self.name)
        again = turn > 0
        if self.name == "claude":
            return [bin_, "-p", prompt, "--dangerously-skip-permissions", *(["--continue"] if again else [])]
        if self.name == "codex":
            return [bin_, "exec", *(["resume", "--last"] if again else []), "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox", prompt]
        if self.name == "opencode":
            return [bin_, "run", *(["--continue"] if again else []), prompt]
        return [bin_, "-p", prompt, "--yolo", *(["--continue"] if again else [])]


CODEX_CONFIG = """model = "{model}"
model_provider = "kvtier"

[model_providers.kvtier]
name = "kvtier"
base_url = "{url}/v1"
env_key = "KVTIER_API_KEY"
wire_api = "responses"
"""


def opencode_config(url: str, model: str) -> dict:
    return {"$schema": "https://opencode.ai/config.json", "model": f"kvtier/{model}",
            "provider": {"kvtier": {"npm": "@ai-sdk/openai-compatible", "name": "kvtier",
                                    "options": {"baseURL": f"{url}/v1", "apiKey": API_KEY},
                                    "models": {model: {"name": model}}}}}


REQUEST_LINE = re.compile(r"request \S+ \w+: (\d+) prompt tokens \((?:none cached, )?.*?(\d+) computed\)")


def finished_requests(log_text: str) -> list[tuple[int, int]]:
    """(prompt tokens, of them cached) of each finished request, in order, from the server's log."""
    return [(int(prompt), int(prompt) - int(computed)) for prompt, computed in REQUEST_LINE.findall(log_text)]


class Session:
    """One agent's three turns against a server whose log is log_path: per turn, its requests (prompt tokens,
    cached) and wall time."""

    def __init__(self, agent: Agent, log_path: Path):
        self.agent, self.log_path = agent, log_path
        self.turns: list[list[tuple[int, int]]] = []
        self.seconds: list[float] = []

    def run(self) -> "Session":
        for turn, prompt in enumerate(TURNS):
            before = len(self._requests())
            start = time.perf_counter()
            proc = self.agent.run(turn, prompt)
            self.seconds.append(time.perf_counter() - start)
            if ANSWER not in proc.stdout:
                raise AgentFailed(f"{self.agent.name} turn {turn + 1} did not print the answer:\n{proc.stdout[-2000:]}")
            if self.agent.tool_runs() != turn + 1:
                raise AgentFailed(f"{self.agent.name} turn {turn + 1} did not run its tool")
            self.turns.append(self._requests()[before:])
        return self

    def later_shares(self) -> list[float]:
        """The cached share of each request's prompt in the turns after the first."""
        return [cached / prompt for turn in self.turns[1:] for prompt, cached in turn]

    def _requests(self) -> list[tuple[int, int]]:
        return finished_requests(self.log_path.read_text())


def server_args(args: argparse.Namespace, kv_dir: Path) -> list[str]:
    return ["--model", args.model, "--any-model-name", "--max-model-len", str(args.max_model_len),
            "--kv-pool-tokens", str(2 * args.max_model_len), "--kv-disk-dir", str(kv_dir), "--api-key", API_KEY]


def measure(args: argparse.Namespace) -> dict[str, Session]:
    sessions = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-agents-") as tmp:
        tmp = Path(tmp)
        (tmp / "script.json").write_text(json.dumps(script()))
        log_path = tmp / "server.log"
        with running_server(server_args(args, tmp / "kv"), log_path,
                            env={"KVTIER_TEST_SCRIPT": str(tmp / "script.json")}) as url:
            for name in args.agents:
                (tmp / name).mkdir()
                sessions[name] = Session(Agent(name, url, tmp / name), log_path).run()
                print(f"{name}: {sessions[name].turns}")
    return sessions


def render(sessions: dict[str, Session], args: argparse.Namespace, command: str) -> str:
    if args.shape:
        model, section = f"random-weight `{args.shape}`", SECTION
    else:       # a model of the user's: a section of its own beside the tiny shape's
        name = os.path.basename(os.path.normpath(args.model))
        model, section = f"`{name}`", f"{SECTION[:-1]}, {name})"
    lines = header(section, cpu_model(), command)
    lines += [f"Model: {model}, {args.max_model_len}-token context, replies scripted by constrained decoding "
              "(a tool call, then a short answer, each turn); the requests are the agents' own. Each turn is one "
              "headless run of the agent (a new process resuming the session).", "",
              "| agent | API | requests per turn | prompt tokens (first request) | turns 2-3: prompt tokens | "
              "of them cached | lowest share of a request | seconds per turn |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    apis = {"claude": "Anthropic Messages", "codex": "Responses", "opencode": "chat completions",
            "qwen": "chat completions"}
    for name, session in sessions.items():
        later = [r for turn in session.turns[1:] for r in turn]
        prompt, cached = sum(p for p, _ in later), sum(c for _, c in later)
        lines.append(f"| {name} | {apis[name]} | {', '.join(str(len(t)) for t in session.turns)} | "
                     f"{session.turns[0][0][0]} | {prompt} | {cached} ({cached / prompt:.1%}) | "
                     f"{min(session.later_shares()):.1%} | {', '.join(f'{s:.1f}' for s in session.seconds)} |")
    lowest = min(min(s.later_shares()) for s in sessions.values())
    lines += ["", f"Target: every request after the first turn finds at least {CACHED_SHARE_TARGET:.0%} of its "
                  f"prompt cached: {verdict(lowest >= CACHED_SHARE_TARGET)} (lowest {lowest:.1%}).", ""]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench agents", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", default=",".join(SHELL_TOOLS), help="comma-separated, of " + ", ".join(SHELL_TOOLS))
    p.add_argument("--max-model-len", type=int, default=65536, help="the agents' own prompts are 7-18K tokens")
    add_model_args(p)
    add_output_args(p)
    args = p.parse_args(argv)
    args.agents = args.agents.split(",")
    args.device, args.dtype = "cpu", None
    if not args.model and not args.shape:
        args.shape = "tiny-llama3"
    return args


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.agents", argv, parse_args)
    if not AGENTS_BIN.is_dir():
        raise SystemExit("the agents are not installed: make .agents/.installed")
    resolve_model(args)
    publish(render(measure(args), args, command), args)


if __name__ == "__main__":
    main()
