"""Needle in a haystack: passkey recall under bounded KV residency, per context length, budget and policy.

Each case is the classic passkey prompt: an instruction, filler sentences, the needle ("The pass key
is 71432. ...") at a chosen depth of the filler, and the question; a random 5-digit key per case. The
same cases run with exact attention and with every policy at each residency budget (a share of the
context length, and a fixed number of tokens), each case on a fresh engine. Recall is whether the greedy
answer contains the key; decode is timed from the first token to the last.

A chat probe asks the same of a natural multi-turn conversation at the fixed budget: the key is told
in one user turn and asked for at the end, and nothing begins the answer, so the pager has to bring
the key's blocks back while the answer is decoded (in the passkey prompt, the begun answer is part of
the prompt, which is computed exactly).

    python -m kvtier.bench.niah [--lengths 1024,2048,4096,8192] [--depths 0,0.25,0.5,0.75,1] [--trials 3] [--no-write]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from kvtier.bench.heatmap import write_heatmap
from kvtier.bench.report import (
    add_device_args,
    add_output_args,
    cpu_model,
    device_settings,
    header,
    int_list,
    name_list,
    parse_command,
    publish,
    verdict,
)
from kvtier.bench.ttft import conversation
from kvtier.config import BOUNDED_BLOCK_SIZE, KV_POLICIES, Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams

SECTION = "## Needle in a haystack (bounded residency)"
ANSWER_TOKENS = 12            # greedy tokens after the question; the context is capped to leave room for them
RECALL_FRACTIONS = (0.125, 0.0625)  # the budgets whose recall must match exact attention...
RECALL_MAX_LENGTH = 8192            # ...at every length up to this
DECODE_LONG, DECODE_SHORT = 8192, 1024  # decode at DECODE_LONG with the fixed budget vs DECODE_SHORT exact
TRAFFIC = ("page_ins", "page_outs", "reselects", "reselect_seconds")   # residency counters taken as differences

INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_START = "The pass key is"     # the answer is begun for the model
CHAT_TURNS = (0.25, 0.5, 0.75)       # where the chat probe tells the key, as a share of the turns
CHAT_KEY = "Before we go on, please remember this: the pass key is {key}. "
CHAT_QUESTION = "What is the pass key I asked you to remember? Answer with the number only."


@dataclass(frozen=True)
class Budget:
    """Resident tokens per sequence: a fraction of the context length (rounded down to whole blocks),
    a fixed number of tokens, or neither: exact attention over the whole context."""
    fraction: float | None = None
    tokens: int | None = None

    @property
    def label(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        return f"{self.tokens} tokens" if self.tokens else "full"

    @property
    def slug(self) -> str:
        return self.label.replace("%", "").replace(" tokens", "tok")

    def at(self, length: int, block_size: int) -> int | None:
        if self.fraction is not None:
            return int(self.fraction * length) // block_size * block_size
        return self.tokens


# --- the cases ----------------------------------------------------------------------------------

def passkey_prompt(tokenizer, filler: list[str], depth: float, key: int) -> list[int]:
    """Instruction, filler with the needle after round(depth × sentences) of them, and the question as the user
    message of the chat template, then the start of the answer (all plain text for a model without a template).
    With exact attention the bundled model recalls from both; templated, it stops after the key."""
    at = round(depth * len(filler))
    text = " ".join([INTRO, *filler[:at], NEEDLE.format(key=key), *filler[at:]])
    if not tokenizer.hf.chat_template:
        return tokenizer.encode(f"{text} {QUESTION} {ANSWER_START}")
    return (tokenizer.apply_chat_template([{"role": "user", "content": f"{text}\n\n{QUESTION}"}])
            + tokenizer.hf(ANSWER_START, add_special_tokens=False).input_ids)


def make_case(tokenizer, context: int, depth: float, seed: str) -> dict:
    """The longest prompt of at most context tokens, with its key."""
    rng = random.Random(seed)
    key = rng.randint(10000, 99999)
    filler = [FILLER[i % len(FILLER)] for i in range(context)]   # more than fits: a sentence is at least a token
    lo, hi = 0, len(filler)                # binary search for the most sentences that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(passkey_prompt(tokenizer, filler[:mid], depth, key)) <= context:
            lo = mid
        else:
            hi = mid - 1
    return {"depth": depth, "key": key, "prompt": passkey_prompt(tokenizer, filler[:lo], depth, key)}


def recall_chat(tokenizer, length: int, key: int, where: float) -> list[dict]:
    """A multi-turn chat of about `length` tokens whose user turn at `where` (a share of the turns) first tells
    the pass key, then the question."""
    messages = conversation(tokenizer, length, seed=3)
    i = int(where * len(messages)) // 2 * 2        # user turns sit at even indexes
    messages[i] = {"role": "user", "content": CHAT_KEY.format(key=key) + messages[i]["content"]}
    return messages + [{"role": "user", "content": CHAT_QUESTION}]


# --- the run ------------------------------------------------------------------------------------

def engine(args: argparse.Namespace, pool_tokens: int, budget: int | None, policy: str | None) -> LLMEngine:
    eng = LLMEngine(Config(model=args.model, num_threads=args.threads, kv_pool_tokens=pool_tokens,
                           **device_settings(args), block_size=BOUNDED_BLOCK_SIZE, prefix_cache=False,
                           kv_disk_dir=args.kv_dir, kv_disk_gib=64.0, kv_host_gib=4.0, kv_resident_tokens=budget,
                           kv_policy=policy or Config.kv_policy))
    # a first request below one block: later timings pay no first-call costs
    ask(eng, "warm-up", eng.tokenizer.encode(" ".join(FILLER))[:40], max_tokens=3)
    return eng


def residency(eng: LLMEngine) -> dict:
    return dict(eng.stats().get("residency", {}))


def ask(eng: LLMEngine, request_id: str, prompt: list[int], max_tokens: int = ANSWER_TOKENS) -> dict:
    """The greedy answer (cut at end-of-sequence), decode time and tokens after the first, and the residency
    counters over the decode (None without residency)."""
    eng.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while eng.has_unfinished():        # until the saves have landed too
        for out in eng.step():
            tokens += out.new_token_ids
            if out.new_token_ids and len(tokens) == len(out.new_token_ids):
                first, before = time.perf_counter(), residency(eng)
            if out.finished:
                last, after = time.perf_counter(), residency(eng)
    eos = next((i for i, t in enumerate(tokens) if t in eng.tokenizer.eos_token_ids), len(tokens))
    return {"answer": eng.tokenizer.decode(tokens[:eos]), "decode_tokens": len(tokens) - 1,
            "decode_seconds": last - first,
            "traffic": {k: after[k] - before[k] for k in TRAFFIC} if after else None,
            "max_resident_blocks": after.get("max_resident_blocks")}


def run_cell(args: argparse.Namespace, cases: list[dict], budget: int | None, policy: str | None, tag: str) -> dict:
    """Every case of a cell on one engine. Prompts are computed exactly in every mode, so the exact cell,
    run first, saves each prompt's blocks to a disk tier shared by all cells, and later cells restore them
    instead of prefilling again: the answers are those of a cold run, and the decode being timed is the same."""
    eng = engine(args, max(len(c["prompt"]) for c in cases) + ANSWER_TOKENS + 64, budget, policy)
    runs = []
    for i, case in enumerate(cases):
        run = ask(eng, f"{tag}-{i}", case["prompt"])
        run.update(depth=case["depth"], prompt_tokens=len(case["prompt"]), correct=str(case["key"]) in run["answer"])
        runs.append(run)
    eng.shutdown()
    del eng
    gc.collect()
    recall = sum(r["correct"] for r in runs) / len(runs)
    print(f"  {tag}: recall {recall:.2f}, answers {[r['answer'] for r in runs[:3]]}...", flush=True)
    return {"budget": budget, "runs": runs}


def restore_probe(args: argparse.Namespace, case: dict, budget: int) -> dict:
    """A bounded conversation saved, then continued on a fresh engine over the same disk directory: how many
    blocks its restore moved to the device, against the budget."""
    disk_dir = tempfile.mkdtemp(prefix="kvtier-niah-")
    settings = dict(model=args.model, num_threads=args.threads, **device_settings(args),
                    kv_pool_tokens=len(case["prompt"]) + 256,
                    prefix_cache=False, kv_disk_dir=disk_dir, kv_resident_tokens=budget)
    first = LLMEngine(Config(**settings))
    first.add_request("saved", case["prompt"], SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0))
    answer = []
    while first.has_unfinished():
        answer += [t for out in first.step() for t in out.new_token_ids]
    first.shutdown()
    second = LLMEngine(Config(**settings))
    jobs, load = [], second.kv.mover.load
    second.kv.mover.load = lambda job: (jobs.append(job), load(job))
    second.add_request("continued", case["prompt"] + answer, SamplingParams(max_tokens=1, temperature=0.0))
    cached = 0
    while second.has_unfinished():
        cached = max([cached, *(out.num_cached_tokens for out in second.step())])
    second.shutdown()
    shutil.rmtree(disk_dir)
    job = jobs[0] if jobs else None
    moved = sum(job.manifest.resident) if job and job.manifest else None
    return {"budget_blocks": budget // second.pool.block_size, "cached": cached,
            "prompt_tokens": len(case["prompt"]) + len(answer),
            "manifest_blocks": len(job.keys) if job else 0, "moved_blocks": moved,
            "moved_bytes": job.bytes if job else 0, "restore_seconds": job.seconds if job else None}


def chat_probe(args: argparse.Namespace, cases: list[dict], budget: int) -> dict:
    """The chat cases with exact attention (first: its prompt blocks go to the disk tier), then at the budget
    with every policy: policy (None: exact) → runs."""
    return {policy: run_cell(args, cases, None if policy is None else budget, policy,
                             f"chat-{policy or 'exact'}")["runs"] for policy in [None, *args.policies]}


def min_budget() -> int:
    """The smallest kv_resident_tokens Config accepts: sink, tail and one scored block."""
    c = Config(block_size=BOUNDED_BLOCK_SIZE)
    return (c.kv_sink_blocks + c.kv_tail_blocks + 1) * c.block_size


def budgets(args: argparse.Namespace) -> list[Budget]:
    fixed = [Budget(tokens=args.fixed_budget)] if args.fixed_budget else []
    return [Budget(), *(Budget(fraction=f) for f in args.budgets), *fixed]


def measure(args: argparse.Namespace) -> dict:
    """Per (length, budget label, policy; None for exact attention) cell: its runs, one per depth and trial,
    or the reason it was skipped. Cells with the same resident tokens at a length are run once."""
    probe = LLMEngine(Config(model=args.model, num_threads=args.threads, **device_settings(args),
                             kv_pool_tokens=64, prefix_cache=False,
                             kv_disk=False, kv_host_gib=0, block_size=BOUNDED_BLOCK_SIZE))
    block_size = probe.config.block_size
    results = {"model": probe.model_name, "dtype": probe.config.dtypes, "threads": torch.get_num_threads(),
               "block_bytes": probe.pool.block_bytes,
               "block_size": block_size, "max_model_len": probe.max_model_len, "min_budget": min_budget(),
               "lengths": args.lengths, "depths": args.depths, "policies": args.policies, "budgets": budgets(args),
               "chat": bool(probe.tokenizer.hf.chat_template), "cells": {}}
    cases = {length: [make_case(probe.tokenizer, min(length, probe.max_model_len - ANSWER_TOKENS), depth,
                                f"{length}-{depth}-{trial}")
                      for depth in args.depths for trial in range(args.trials)] for length in args.lengths}
    chat_length = min(args.chat_length, probe.max_model_len - 3 * ANSWER_TOKENS)
    chat_cases = [{"depth": where, "key": (key := random.Random(f"chat-{where}").randint(10000, 99999)),
                   "prompt": probe.tokenizer.apply_chat_template(recall_chat(probe.tokenizer, chat_length, key, where))}
                  for where in CHAT_TURNS] if args.chat_length and probe.tokenizer.hf.chat_template else []
    del probe
    if args.fixed_budget:      # first, so that a failure here costs minutes, not the whole run
        longest = max(args.lengths)
        results["restore"] = restore_probe(args, cases[longest][len(cases[longest]) // 2], args.fixed_budget)
        print(f"restore probe: {results['restore']}", flush=True)
    args.kv_dir = tempfile.mkdtemp(prefix="kvtier-niah-kv-")
    if args.fixed_budget and chat_cases:
        results["chat_probe"] = chat_probe(args, chat_cases, args.fixed_budget)
    done: dict[tuple, dict] = {}
    for length in args.lengths:
        print(f"context {length}: prompts of {min(len(c['prompt']) for c in cases[length])}-"
              f"{max(len(c['prompt']) for c in cases[length])} tokens", flush=True)
        for budget in results["budgets"]:
            tokens = budget.at(length, block_size)
            for policy in ([None] if tokens is None else args.policies):
                if tokens is not None and tokens < results["min_budget"]:
                    cell = {"budget": tokens, "skipped": f"below the {results['min_budget']}-token minimum"}
                elif (length, tokens, policy) in done:
                    cell = done[length, tokens, policy]
                else:
                    cell = run_cell(args, cases[length], tokens, policy, f"{length}-{budget.slug}-{policy or 'exact'}")
                    done[length, tokens, policy] = cell
                results["cells"][length, budget.label, policy] = cell
    shutil.rmtree(args.kv_dir)
    return results


# --- the report ---------------------------------------------------------------------------------

def summarize(cell: dict, block_bytes: int, block_size: int) -> dict:
    """Recall, decode tokens/s, device KV bytes per sequence and residency traffic over the decode."""
    runs = cell["runs"]
    tokens = sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["decode_seconds"] for r in runs)
    row = {"recall": sum(r["correct"] for r in runs) / len(runs), "decode_tps": tokens / seconds,
           "prompt_tokens": (min(r["prompt_tokens"] for r in runs), max(r["prompt_tokens"] for r in runs))}
    if cell["budget"] is None:   # exact attention: every block of the longest prompt and its answer
        row["kv_bytes"] = -(-(row["prompt_tokens"][1] + ANSWER_TOKENS) // block_size) * block_bytes
    else:
        most = [r["max_resident_blocks"] for r in runs]
        row["kv_bytes"] = None if None in most else max(most) * block_bytes
    traffic = [r["traffic"] for r in runs]
    if cell["budget"] is not None and None not in traffic:
        for k in ("page_ins", "page_outs"):
            row[k] = sum(t[k] for t in traffic) / tokens
        row["reselect_share"] = sum(t["reselect_seconds"] for t in traffic) / seconds
    return row


def by_depth(cell: dict, depths: list[float]) -> list[float | None]:
    """Recall per depth, over the trials; None for a skipped cell."""
    if "skipped" in cell:
        return [None] * len(depths)
    return [sum(r["correct"] for r in cell["runs"] if r["depth"] == d) / sum(r["depth"] == d for r in cell["runs"])
            for d in depths]


def heatmaps(results: dict) -> list[tuple[str, str, Budget, str | None]]:
    """(file name, title, budget, policy) of every heatmap: exact attention, then each budget and policy."""
    maps = []
    for budget in results["budgets"]:
        if budget == Budget():
            maps.append(("niah-full.png", "NIAH recall: full attention", budget, None))
            continue
        what = f"{budget.label} of context" if budget.fraction is not None else budget.label
        maps += [(f"niah-{policy}-{budget.slug}.png", f"NIAH recall: {policy}, budget {what}", budget, policy)
                 for policy in results["policies"]]
    return maps


def write_heatmaps(results: dict, directory: str) -> list[str]:
    """One PNG per budget and policy, depth (rows) × context length (columns); returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, title, budget, policy in heatmaps(results):
        columns = [by_depth(results["cells"][length, budget.label, policy], results["depths"])
                   for length in results["lengths"]]
        path = os.path.join(directory, name)
        write_heatmap(path, [list(row) for row in zip(*columns)], [f"{d:g}" for d in results["depths"]],
                      [str(length) for length in results["lengths"]], title, "depth", "context length (tokens)")
        paths.append(path)
    return paths


def mib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**20:.1f} MiB"


def num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def table(results: dict, rows: dict) -> list[str]:
    lines = [("| context | KV budget (tokens) | policy | recall | device KV / sequence | page-ins / decoded token "
              "| page-outs / decoded token | reselection share of decode | decode tokens/s |"),
             "| ---: | ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for length in results["lengths"]:
        for budget in results["budgets"]:
            for policy in [None] if budget == Budget() else results["policies"]:
                cell = results["cells"][length, budget.label, policy]
                size = f" ({cell['budget']})" if budget.fraction is not None else ""
                if "skipped" in cell:
                    if policy == results["policies"][0]:
                        lines.append(f"| {length} | {budget.label}{size} | all | n/a ({cell['skipped']}) "
                                     "| — | — | — | — | — |")
                    continue
                row = rows[length, budget.label, policy]
                lines.append(f"| {length} | {budget.label}{size} | {policy or 'exact'} | {row['recall']:.2f} "
                             f"| {mib(row['kv_bytes'])} | {num(row.get('page_ins'), '.2f')} "
                             f"| {num(row.get('page_outs'), '.2f')} | {num(row.get('reselect_share'), '.1%')} "
                             f"| {row['decode_tps']:.1f} |")
    return lines


def recall_target(results: dict, rows: dict, fraction: float) -> str:
    label = Budget(fraction=fraction).label
    lengths = [n for n in results["lengths"] if n <= RECALL_MAX_LENGTH]
    parts = []
    for policy in results["policies"]:
        pairs = [(n, rows.get((n, label, policy)), rows[n, "full", None]) for n in lengths]
        pairs = [(n, mine["recall"], full["recall"]) for n, mine, full in pairs if mine is not None]
        if pairs:
            ok = all(mine >= full for _, mine, full in pairs)
            parts.append(f"{policy} {verdict(ok)} ("
                         + ", ".join(f"{n}: {mine:.2f} vs {full:.2f}" for n, mine, full in pairs) + ")")
    head = f"- recall at a {label} budget ≥ exact attention on the same cases, every length up to {RECALL_MAX_LENGTH}"
    return f"{head}: " + ("; ".join(parts) if parts else f"not evaluated (no {label} cell ran)")


def bytes_target(results: dict, rows: dict, fixed: int | None) -> str:
    head = f"- device KV bytes per sequence constant once the context exceeds a fixed {fixed}-token budget"
    longer = [n for n in results["lengths"] if fixed and n > fixed]
    if len(longer) < 2 or fixed < results["min_budget"]:
        return f"{head}: not evaluated (needs a --fixed-budget that runs and two lengths above it)"
    parts = []
    for policy in results["policies"]:
        sizes = [rows[n, f"{fixed} tokens", policy]["kv_bytes"] for n in longer]
        ok = None not in sizes and len(set(sizes)) == 1
        parts.append(f"{policy} {verdict(ok)} ({', '.join(f'{n}: {mib(s)}' for n, s in zip(longer, sizes))})")
    return f"{head}: " + "; ".join(parts)


def decode_target(results: dict, rows: dict, fixed: int | None) -> str:
    head = (f"- decode tokens/s at {DECODE_LONG} context with a {fixed}-token budget ≥ at {DECODE_SHORT} with "
            "exact attention")
    short = rows.get((DECODE_SHORT, "full", None))
    if short is None or DECODE_LONG not in results["lengths"] or not fixed or fixed < results["min_budget"]:
        return f"{head}: not evaluated (needs lengths {DECODE_SHORT} and {DECODE_LONG} and a --fixed-budget that runs)"
    parts = [f"{policy} {verdict(tps >= short['decode_tps'])} ({tps:.1f} vs {short['decode_tps']:.1f})"
             for policy in results["policies"]
             for tps in [rows[DECODE_LONG, f"{fixed} tokens", policy]["decode_tps"]]]
    return f"{head}: " + "; ".join(parts)


def how(results: dict, trials: int, rows: dict) -> str:
    depths = ", ".join(f"{d:g}" for d in results["depths"])
    prompts = ", ".join(f"{n}: {row['prompt_tokens'][0]}-{row['prompt_tokens'][1]}"
                        for (n, label, _), row in rows.items() if label == "full")
    form = "the user message of the chat template" if results["chat"] else "plain text"
    return (
        f"How: per context length, {len(results['depths'])} depths ({depths} of the filler) × {trials} trials, "
        f"each a passkey prompt ({form}: \"{INTRO}\", the filler sentences \"{' '.join(FILLER)}\" repeated, the "
        f"needle \"{NEEDLE.format(key=71432)}\" with a seeded random 5-digit key between two sentences at the depth, "
        f"then \"{QUESTION}\"; the answer begun with \"{ANSWER_START}\") of at most the context length in tokens, "
        f"capped at the model's {results['max_model_len']} minus {ANSWER_TOKENS} answer tokens (prompt tokens per "
        f"length: {prompts}). Every cell runs the same cases on one engine per cell (device prefix cache off, "
        f"host tier 4 GiB, a disk tier shared by all cells). Prompts are computed exactly in every mode (bounded "
        f"residency streams paged-out blocks through prefill), so the exact cell computes each prompt once and "
        f"later cells restore its blocks from the disk tier: bounded ones with only the sink and tail resident, the "
        f"rest paged out, as if prefilled there. Greedy, {ANSWER_TOKENS} tokens; a "
        f"case is recalled when the answer (up to end-of-sequence) contains the key. A budget is a share of the "
        f"context length rounded down to whole {results['block_size']}-token blocks, or a fixed number of tokens; "
        f"budgets below {results['min_budget']} tokens (sink, tail and one scored block) are not run, and cells "
        f"with the same resident tokens at a length (by default 6.25% and 512 tokens at 8192) share their runs. "
        f"Device KV per sequence: the most blocks resident at once × block bytes (exact attention: every block of "
        f"the context). Decode: from the first token to the last, over the tokens after the first; page-ins, "
        f"page-outs and reselection time are counted over the same span.")


def chat_lines(results: dict, fixed: int) -> list[str]:
    chat = results.get("chat_probe")
    if not chat:
        return []
    runs = chat[None]
    lines = [f"Chat probe: a {runs[0]['prompt_tokens']}-token multi-turn chat that tells the key in one user "
             f"turn (\"{CHAT_KEY.format(key=71432).strip()}\") and ends with \"{CHAT_QUESTION}\"; nothing begins "
             f"the answer. Greedy answers:", "",
             "| key told in the turn at | exact | " + " | ".join(f"{p}, {fixed} tokens" for p in results["policies"])
             + " |", "| ---: | :--- |" + " :--- |" * len(results["policies"])]
    for i, run in enumerate(runs):
        cells = [chat[policy][i] for policy in [None, *results["policies"]]]
        lines.append(f"| {run['depth']:.0%} of the turns | "
                     + " | ".join(f"{'✓' if c['correct'] else '✗'} {c['answer'].strip()!r}" for c in cells) + " |")
    return [*lines, ""]


def chat_target(results: dict, fixed: int) -> list[str]:
    chat = results.get("chat_probe")
    if not chat:
        return []
    exact = [r["correct"] for r in chat[None]]
    parts = []
    for policy in results["policies"]:
        mine = [r["correct"] for r in chat[policy]]
        ok = all(m or not e for m, e in zip(mine, exact))
        parts.append(f"{policy} {verdict(ok)} ({sum(mine)} of {len(mine)}, exact {sum(exact)})")
    return [f"- the chat probe with a {fixed}-token budget recalls the key wherever exact attention does: "
            + "; ".join(parts)]


def restore_target(results: dict) -> list[str]:
    r = results.get("restore")
    if r is None:
        return []
    ok = r["moved_blocks"] is not None and r["moved_blocks"] <= r["budget_blocks"]
    moved = "no manifest restore happened" if r["moved_blocks"] is None else (
        f"{r['moved_blocks']} of {r['manifest_blocks']} saved blocks ({r['moved_bytes'] / 2**20:.1f} MiB, "
        f"{r['restore_seconds'] * 1e3:.0f} ms) for a budget of {r['budget_blocks']}; "
        f"{r['cached']} of {r['prompt_tokens']} prompt tokens cached")
    return [f"- restoring a bounded {r['prompt_tokens']}-token conversation in a fresh engine moves at most its "
            f"budget of blocks to the device: {verdict(ok)} ({moved})"]


def render(results: dict, args: argparse.Namespace, command: str) -> str:
    rows = {key: summarize(cell, results["block_bytes"], results["block_size"])
            for key, cell in results["cells"].items() if "skipped" not in cell}
    docs = os.path.relpath(args.docs_dir, os.path.dirname(os.path.abspath(args.output)))
    links: dict[str, list[str]] = {}
    for name, _, budget, policy in heatmaps(results):
        path = os.path.normpath(os.path.join(docs, name))
        links.setdefault(budget.label, []).append(f"[{policy or 'exact'}]({path})")
    machine = (f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {results['threads']} threads, "
               f"model {results['model']} ({results['dtype']}, {results['block_bytes']} bytes of KV per "
               f"{results['block_size']}-token block)")
    return "\n".join([
        *header(SECTION, machine, command),
        *table(results, rows),
        "",
        "Targets:",
        "",
        *(recall_target(results, rows, f) for f in RECALL_FRACTIONS),
        bytes_target(results, rows, args.fixed_budget),
        decode_target(results, rows, args.fixed_budget),
        *restore_target(results),
        *chat_target(results, args.fixed_budget),
        "",
        *chat_lines(results, args.fixed_budget),
        "Heatmaps of recall by depth (rows) and context length (columns), per budget:",
        "",
        *(f"- {label}: {' · '.join(maps)}" for label, maps in links.items()),
        "",
        how(results, args.trials, rows),
        "",
    ])


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench niah", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=[1024, 2048, 4096, 8192],
                   help="context lengths in tokens, comma-separated (capped at the model's limit)")
    p.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths, fractions of the filler, comma-separated")
    p.add_argument("--trials", type=int, default=2, help="cases per length and depth, each with its own key")
    p.add_argument("--policies", type=name_list, default=list(KV_POLICIES),
                   help=f"residency policies, comma-separated (default: {','.join(KV_POLICIES)})")
    p.add_argument("--budgets", type=float_list, default=[0.25, 0.125, 0.0625],
                   help="resident-token budgets as fractions of the context length, comma-separated")
    p.add_argument("--fixed-budget", type=int, default=512, help="a budget in tokens at every length; 0: none")
    p.add_argument("--chat-length", type=int, default=8000,
                   help="tokens of the chat probe, run at the fixed budget; 0: no chat probe")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    add_device_args(p)
    add_output_args(p)
    p.add_argument("--docs-dir", default="docs", help="where the heatmap PNGs go")
    args = p.parse_args(argv)
    unknown = set(args.policies) - set(KV_POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(KV_POLICIES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.niah", argv, parse_args)
    torch.set_num_threads(args.threads)
    results = measure(args)
    section = render(results, args, command)
    if not args.no_write:
        for path in write_heatmaps(results, args.docs_dir):
            print(f"wrote {path}")
    publish(section, args)


if __name__ == "__main__":
    main()
