"""Speculative decoding on agent-shaped turns: decode speed, acceptance and cache reuse with speculation off, by
prompt lookup (ngram) and by a draft model (the served model drafting for itself unless --draft-model says otherwise).

Three workloads, each a few two-turn conversations with new contexts every turn (different files, tool results and
questions, so no turn's prompt is another's):
- editing: repeat a 1-2K-token module of Python's standard library with one change (an agent rewriting a file);
- quoting: answer by quoting a tool result the conversation holds (another module's first lines);
- chat: open questions whose answers are nowhere in the context.
The second turn of each conversation extends the first (its answer and a follow-up), so its prompt is served from
the prefix cache: the hit ratio must be the same with speculation on and off, and so must the greedy text. Engines
with speculation off and on run each turn alternately, in one process.

    python -m kvtier.bench.spec [--conversations 3] [--max-tokens 256] [--methods off,ngram,draft]
                                [--draft-model PATH] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import sysconfig
import time

from kvtier.bench.report import (add_device_args, add_output_args, device_settings, engine_machine, header,
                                 name_list, parse_command, publish, verdict)
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.models.loader import resolve_model_path

SECTION = "## Speculative decoding"     # one section per weights mode (--quantize)
POOL_TOKENS = 32768    # each engine's pool: a workload's conversations, both turns, with room to spare
WORKLOADS = ("editing", "quoting", "chat")
METHODS = ("ngram", "draft")    # --speculative's, timed against off (DFlash has no drafter weights here)
EDIT_TARGET = 2.0      # decode tokens/s with ngram / without, editing workload
CHAT_TARGET = 0.95     # the same on plain chat
STDLIB = sysconfig.get_paths()["stdlib"]
# the files the editing and quoting workloads quote: Python's own, so that a run quotes what every run on this Python
# does (kvtier's files change as it does), each in Python 3.9-3.13, picked by length before any was measured: whole
# modules of 1-2K tokens with attributes to rename, and ones of 600-1,600 tokens whose first 3,000 characters make
# a tool result; one conversation per file and per question
EDITED = ("sched.py", "reprlib.py", "netrc.py", "hmac.py", "codeop.py", "rlcompleter.py")
QUOTED = ("bisect.py", "signal.py", "linecache.py", "genericpath.py", "getpass.py", "fnmatch.py")
QUESTIONS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how a refrigerator works to a ten-year-old.",
             "What are the pros and cons of living in a big city? Answer in a few paragraphs.",
             "Describe your ideal weekend, in detail.",
             "Why is the sky blue? Give a thorough explanation.",
             "Compare keeping a cat with keeping a dog, point by point."]


EDITED_TOKENS = 2000   # an edited module's tokens at most
QUOTED_CHARS = 3000    # a quoted module's characters: its tool result


def stdlib_text(name: str) -> str:
    with open(os.path.join(STDLIB, name)) as f:
        return f.read()


def attribute(text: str) -> str:
    """The first of self's attributes (methods included) in text named with four characters or more: the one the
    edit renames."""
    return "self." + re.search(r"\bself\.(\w{4,})", text)[1]


def conversations(tokenizer, workload: str, num: int) -> list[list[list[dict]]]:
    """Per conversation, its two turns' follow-up messages (each turn appends its answer and the next)."""
    if workload == "editing":
        texts = [(name, tokenizer.decode(tokenizer.encode(stdlib_text(name))[:EDITED_TOKENS])) for name in EDITED[:num]]
        edits = [(name, text, attribute(text)) for name, text in texts]
        return [[[{"role": "user", "content": f"Here is {name}:\n\n```python\n{text}\n```\n\nRepeat the whole file "
                   f"exactly, but rename `{ident}` to `{ident}_renamed`."}],
                 [{"role": "user", "content": "Now repeat it again, unchanged from your version."}]]
                for name, text, ident in edits]
    if workload == "quoting":
        return [[[{"role": "user", "content": f"Run the tests of {name}."},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                      "name": "read_file", "arguments": f'{{"path": "{name}"}}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": stdlib_text(name)[:QUOTED_CHARS]},
                  {"role": "user", "content": "Quote the first function of that file verbatim."}],
                 [{"role": "user", "content": "Quote the last lines of the file verbatim."}]]
                for name in QUOTED[:num]]
    return [[[{"role": "user", "content": question}], [{"role": "user", "content": "Now say it again, but shorter."}]]
            for question in QUESTIONS[:num]]


def quoted(args: argparse.Namespace) -> str:
    """The sentence that names the modules the run's workloads quote (none for plain chat)."""
    n = args.conversations
    parts = [f"the {w} workload {verb} {', '.join(names[:n])}" for w, verb, names in
             (("editing", "edits", EDITED), ("quoting", "quotes", QUOTED)) if w in args.workloads]
    return f" From Python {platform.python_version()}'s library, {' and '.join(parts)}." if parts else ""


def run_turn(eng: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy turn: its tokens, decode tokens/s after the first, and its cached prompt tokens."""
    eng.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens, first, cached = [], None, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    seconds = time.perf_counter() - first
    return {"tokens": tokens, "seconds": seconds, "decoded": len(tokens) - 1, "cached": cached,
            "prompt": len(prompt)}


def measure(engines: dict[str, LLMEngine], workload: str, args: argparse.Namespace) -> dict:
    tok = next(iter(engines.values())).tokenizer
    totals = {name: {"decoded": 0, "seconds": 0.0, "cached": 0, "prompt": 0, "texts": [], "turns": {}}
              for name in engines}
    spec = {name: dict(eng.speculator.stats()) for name, eng in engines.items() if eng.speculator}
    for c, turns in enumerate(conversations(tok, workload, args.conversations)):
        histories = dict.fromkeys(engines, [])
        for t, follow_up in enumerate(turns):
            for name, eng in engines.items():       # alternately, turn by turn
                history = histories[name] + follow_up
                prompt = tok.apply_chat_template(history)
                got = run_turn(eng, f"{workload}-{c}-{t}", prompt, args.max_tokens)
                histories[name] = history + [{"role": "assistant", "content": tok.decode(got["tokens"])}]
                total = totals[name]
                for key in ("decoded", "seconds", "cached", "prompt"):
                    total[key] += got[key]
                total["texts"].append(got["tokens"])
                turn = total["turns"].setdefault(t, [0, 0.0])      # decoded tokens and seconds of every t-th turn
                turn[0], turn[1] = turn[0] + got["decoded"], turn[1] + got["seconds"]
                print(f"  {workload} {c}.{t} {name}: {got['decoded'] / got['seconds']:.1f} tok/s, "
                      f"{got['cached']}/{got['prompt']} cached", flush=True)
    for name, eng in engines.items():
        if eng.speculator:
            now = eng.speculator.stats()
            steps = now["verify_steps"] - spec[name]["verify_steps"]
            accepted = now["accepted_tokens"] - spec[name]["accepted_tokens"]
            totals[name]["acceptance"] = 1 + accepted / steps if steps else None
            totals[name]["proposed"] = now["proposed_tokens"] - spec[name]["proposed_tokens"]
            totals[name]["accepted"] = accepted
    return totals


def turn_rates(total: dict) -> list[float]:
    """Decode tokens/s over every conversation's first turn, its second, ...: one method's totals."""
    return [decoded / seconds for _, (decoded, seconds) in sorted(total["turns"].items())]


def ceiling(speculator) -> float | None:
    """Decode speed over off with every proposal accepted, at the best k measured: k + 1 tokens a step that costs
    1 + c(k) decode steps (one sequence). None if no cost was measured."""
    return max(((k + 1) / (1 + speculator.draft_cost(k)) for k in speculator.draft_costs), default=None)


def table(results: dict, names: list[str]) -> list[str]:
    off = names[0]
    lines = ["| workload | speculation | decode tok/s | × off | tokens per verify step | accepted / proposed | "
             "prefix-cache hit ratio | same text as off |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for workload, totals in results.items():
        base = totals[off]["decoded"] / totals[off]["seconds"]
        for name in names:
            t = totals[name]
            rate = t["decoded"] / t["seconds"]
            accept = f"{t['acceptance']:.2f}" if t.get("acceptance") else "–"
            ratio = f"{t['accepted']}/{t['proposed']}" if "proposed" in t else "–"
            lines.append(f"| {workload} | {name} | {rate:.1f} | {rate / base:.2f} | {accept} | {ratio} | "
                         f"{t['cached'] / t['prompt']:.3f} | {'yes' if t['texts'] == totals[off]['texts'] else 'NO'} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.spec", argv, parse_args)
    resolve_model(args)
    # every engine's pool sized for the conversations, not a share of free memory: on a GPU the first engine would
    # take most of it and leave the others (the draft model's two copies of the weights) too little
    settings = dict(model=args.model, **device_settings(args), num_threads=args.threads, kv_host_gib=0, kv_disk=False,
                    kv_pool_tokens=POOL_TOKENS, num_speculative_tokens=args.num_speculative_tokens)
    if args.quantize:
        settings["quantize"] = args.quantize
    draft = {"draft_model": args.draft_model or resolve_model_path(args.model)}
    engines = {name: LLMEngine(Config(**settings, **(draft if name == "draft" else {}),
                                      speculative=None if name == "off" else name))
               for name in args.methods}
    results = {w: measure(engines, w, args) for w in args.workloads}
    names = list(engines)
    rate = {w: {n: t["decoded"] / t["seconds"] for n, t in totals.items()} for w, totals in results.items()}
    weights = engines["off"].weights_mode
    costs = "; ".join(f"{name}: " + (", ".join(f"k={k} {eng.speculator.draft_cost(k):.2f}"
                                               for k in sorted(eng.speculator.draft_costs)) or "none measured")
                      for name, eng in engines.items() if eng.speculator)
    drafter = f" The draft model is {engines['draft'].drafter.name}." if "draft" in engines else ""
    lines = [*header(f"{SECTION}, weights: {weights}", engine_machine(engines["off"]), command),
             f"{args.conversations} two-turn conversations per workload, greedy, up to {args.max_tokens} tokens per "
             f"turn, --num-speculative-tokens {args.num_speculative_tokens}. Decode tok/s counts the tokens after "
             "each turn's first over the time after it; the hit ratio is cached prompt tokens over prompt tokens, "
             f"both turns.{quoted(args)}{drafter} No DFlash column: there are no DFlash drafter weights for this "
             "model here (a random-weight drafter is tested for what it must keep, not timed). What k draft rows "
             "added to a step (the draft model's rounds included), in decode steps' time per token, as each "
             f"speculator measured it while serving: {costs}.", "", *table(results, names), ""]
    if "draft" in names:       # the targets are prompt lookup's; a draft model's ratios are measured only
        lines.append("- draft / off (a model drafting for itself: no target): " + ", ".join(
            f"{w} {rate[w]['draft'] / rate[w]['off']:.2f}×" for w in rate))
    for name in (n for n in names[1:] if n != "draft"):
        if "editing" in rate:
            ratio = rate["editing"][name] / rate["editing"]["off"]
            best = ceiling(engines[name].speculator)
            by_turn = ", ".join(f"turn {t} {a / b:.2f}×" for t, (a, b) in enumerate(
                zip(turn_rates(results["editing"][name]), turn_rates(results["editing"]["off"])), 1))
            lines.append(f"- {name} / off on editing: {ratio:.2f}× (target ≥ {EDIT_TARGET}×: "
                         f"{verdict(ratio >= EDIT_TARGET)}; by turn: {by_turn})" + ("" if best is None else
                         f"; at the row costs last measured, every proposal accepted would give {best:.2f}×"))
        if "chat" in rate:
            ratio = rate["chat"][name] / rate["chat"]["off"]
            lines.append(f"- {name} / off on plain chat: {ratio:.2f}× (target ≥ {CHAT_TARGET}×: "
                         f"{verdict(ratio >= CHAT_TARGET)})")
    same = all(t[name]["texts"] == t["off"]["texts"] and t[name]["cached"] == t["off"]["cached"]
               for t in results.values() for name in names[1:])
    lines += [f"- greedy text and cached tokens identical with and without speculation: {verdict(same)}", ""]
    for eng in engines.values():
        eng.shutdown()
    publish("\n".join(lines), args)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_device_args(p)
    add_output_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quantize", default=None, help="the server's --quantize (default: auto)")
    p.add_argument("--conversations", type=int, default=3,
                   help=f"conversations per workload (at most {len(QUESTIONS)})")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per turn at most")
    p.add_argument("--num-speculative-tokens", type=int, default=Config.num_speculative_tokens)
    p.add_argument("--workloads", type=name_list, default=list(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    p.add_argument("--methods", type=name_list, default=["off", *METHODS],
                   help=f"off first, then the --speculative methods to run, of {','.join(METHODS)}")
    p.add_argument("--draft-model", default=None, help="the draft model (default: the model itself)")
    args = p.parse_args(argv)
    if not 1 <= args.conversations <= len(QUESTIONS):
        p.error(f"--conversations {args.conversations}: each workload has 1 to {len(QUESTIONS)} conversations")
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown or not args.workloads:
        p.error(f"--workloads: {', '.join(sorted(unknown)) or 'none given'}; the workloads are {', '.join(WORKLOADS)}")
    methods = args.methods[1:]
    if args.methods[:1] != ["off"] or not methods or not set(methods) <= set(METHODS) or \
            len(set(methods)) < len(methods):
        p.error(f"--methods {','.join(args.methods)}: off first (what each method is measured against), then one or "
                f"more of {', '.join(METHODS)}")
    missing = [name for name in EDITED + QUOTED if not os.path.exists(os.path.join(STDLIB, name))]
    if missing and {"editing", "quoting"} & set(args.workloads):
        p.error(f"the editing and quoting workloads quote Python's own {', '.join(missing)}, not in {STDLIB}")
    return args


if __name__ == "__main__":
    main()
