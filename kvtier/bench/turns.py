"""Agent turns on quantized weights: the time to the first token of the turns an agent sends, kvtier on a GGUF
file's blocks beside kvtier on the same weights dequantized to float32 and llama.cpp on the same file, in one
process, alternating.

Turns, each of fresh random tokens: a cold prompt; a prompt sent again whole (a retry: all cached but the last token,
which gives fresh logits); a new prompt of the same length sent again after its answer of --answer tokens (a
regenerated answer: the answer went on past the block after the prompt's last token); a short turn of a few new
tokens after a cached prefix (a tool's result, a user's reply). kvtier runs with its device prefix cache, no tiers;
llama.cpp keeps the prefix in its cache and computes what follows, as its server does with a cached prompt (the whole
prompt again: its last token).

    python -m kvtier.bench.turns [--context 1024] [--cold 512] [--new 16,64] [--answer 128] [--repeats 5] [--no-write]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kvtier.bench import llama_cpp
from kvtier.bench.report import add_output_args, engine_machine, header, int_list, parse_command, publish
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.bench.throughput import first_token, kvtier_decode, random_prompts
from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.models.loader import resolve_model_path


def kvtier_turns(eng: LLMEngine, cold: list[int], base: list[int], news: dict[int, list[int]], answered: list[int],
                 tag: str, answer: int) -> dict:
    """Per turn: (seconds, cached tokens); `answered` regenerated after an answer of `answer` tokens."""
    found = {"cold": first_token(eng, cold, f"{tag}-cold")}
    first_token(eng, base, f"{tag}-base")                     # the prefix, now cached
    found["again"] = first_token(eng, base, f"{tag}-again")
    for n, new in news.items():
        found[n] = first_token(eng, base + new, f"{tag}-new{n}")
    kvtier_decode(eng, [answered], answer, f"{tag}-answer")
    found["regenerated"] = first_token(eng, answered, f"{tag}-regenerated")
    return found


def llama_turns(llama: llama_cpp.LlamaCpp, cold: list[int], base: list[int], news: dict[int, list[int]],
                answered: list[int]) -> dict:
    """As kvtier's; a regenerated answer too computes the prompt's last token after the rest of it, held in the
    cache (the server drops the answer's tokens from it)."""
    found = {"cold": (llama.prefill(cold), 0), "again": (llama.turn(base[:-1], base[-1:]), len(base) - 1)}
    for n, new in news.items():
        found[n] = (llama.turn(base, new), len(base))
    found["regenerated"] = (llama.turn(answered[:-1], answered[-1:]), len(answered) - 1)
    return found


def measure(args: argparse.Namespace, players: dict) -> dict:
    """Per player and turn: every repeat's (seconds, cached tokens)."""
    vocab = next(iter(players.values()))[1]
    gen = torch.Generator().manual_seed(0)
    runs = {name: {} for name in players}
    for rep in range(args.repeats + 1):       # the first a warm-up
        cold, base = random_prompts(gen, 1, args.cold, vocab)[0], random_prompts(gen, 1, args.context, vocab)[0]
        news = {n: random_prompts(gen, 1, n, vocab)[0] for n in args.new}
        answered = random_prompts(gen, 1, args.context, vocab)[0]
        names = list(players)
        for name in names[rep % len(names):] + names[:rep % len(names)]:      # who goes first, in turn
            found = players[name][0](cold, base, news, answered, f"{name}-{rep}")
            for turn, run in found.items():
                if rep:
                    runs[name].setdefault(turn, []).append(run)
    return runs


def render(runs: dict, args: argparse.Namespace, eng: LLMEngine, command: str, llama_note: str) -> str:
    names = list(runs)
    turns = {"cold": f"cold prompt of {args.cold} tokens",
             "again": f"a {args.context}-token prompt sent again (cached but its last token)",
             "regenerated": f"a new {args.context}-token prompt sent again after its {args.answer}-token answer (a "
                            "regenerated answer)",
             **{n: f"{n} new tokens after a cached {args.context}-token prefix" for n in args.new}}
    ms = {name: {turn: statistics.median(s for s, _ in runs[name][turn]) * 1e3 for turn in turns} for name in names}
    lines = header("## Agent turns on quantized weights (kvtier vs kvtier float32 vs llama.cpp)",
                   engine_machine(eng), command)
    lines += ["| turn (time to first token, ms) | " + " | ".join(names) + " | kvtier cached / prompt | " +
              " | ".join(f"kvtier / {name}" for name in names[1:]) + " |",
              "| --- |" + " ---: |" * (2 * len(names))]
    for turn, what in turns.items():
        cached = sorted({c for _, c in runs["kvtier"][turn]})
        prompt = args.cold if turn == "cold" else args.context + (0 if turn in ("again", "regenerated") else turn)
        # a ratio above 1: kvtier's turn came that many times sooner
        ratios = [f"{ms[name][turn] / ms['kvtier'][turn]:.2f}×" for name in names[1:]]
        lines.append(f"| {what} | " + " | ".join(f"{ms[name][turn]:.1f}" for name in names) +
                     f" | {', '.join(map(str, cached))} / {prompt} | " + " | ".join(ratios) + " |")
    lines += ["", f"How: the median of {args.repeats} repeats after a warm-up, each of fresh random tokens, the "
              "players taking turns going first. kvtier: its device prefix cache, no tiers; `kvtier float32` the "
              "same engine with every weight dequantized at load (`--quantize none`). kvtier / X above 1: kvtier's "
              f"first token came that many times sooner. {llama_note}", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench turns", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for every engine")
    p.add_argument("--context", type=int, default=1024, help="the cached prefix's tokens")
    p.add_argument("--cold", type=int, default=512, help="the cold prompt's tokens")
    p.add_argument("--new", type=int_list, default=[16, 64], help="new tokens after the prefix, comma-separated")
    p.add_argument("--answer", type=int, default=128, help="the answer's tokens before the regenerated one")
    p.add_argument("--repeats", type=int, default=5)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.turns", argv, parse_args)
    args.device, args.dtype = "cpu", "float32"
    torch.set_num_threads(args.threads)
    resolve_model(args)
    need = 2 * (2 * args.context + max(args.new + [args.answer]) + args.cold) + 64

    def engine(quantize: str) -> LLMEngine:
        return LLMEngine(Config(model=args.model, device="cpu", num_threads=args.threads, kv_pool_tokens=need,
                                quantize=quantize, kv_host_gib=0, kv_disk=False))

    eng = engine("auto")
    vocab = eng.model.config.vocab_size
    players = {"kvtier": (lambda *a, e=eng: kvtier_turns(e, *a, answer=args.answer), vocab)}
    if eng.model.quantized:
        float_eng = engine("none")
        players["kvtier float32"] = (lambda *a, e=float_eng: kvtier_turns(e, *a, answer=args.answer), vocab)
    path = resolve_model_path(args.model)
    llama_note = "llama.cpp: not measured here, ik-llama-cpp-python is not installed."
    if not path.endswith(".gguf"):
        llama_note = "llama.cpp: not measured (it runs GGUF files)."
    elif llama_cpp.available():
        llama = llama_cpp.LlamaCpp(path, args.threads, need, 1)
        players["llama.cpp"] = (lambda cold, base, news, answered, tag: llama_turns(llama, cold, base, news, answered),
                                vocab)
        llama_note = ("llama.cpp is ik_llama.cpp through the prebuilt ik-llama-cpp-python wheel, on the same file and "
                      "threads, flash attention " + ("on." if llama.flash_attention else "off (the wheel turns it off "
                                                     "without AVX-VNNI).") + llama.rows_note)
    publish(render(measure(args, players), args, eng, command, llama_note), args)


if __name__ == "__main__":
    main()
