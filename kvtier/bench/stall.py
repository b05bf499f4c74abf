"""Decode steps while the disk tier stalls: every file read, write and unlink of the disk tier takes 2 s longer.

Streams decode while, beside them, a new prompt is saved to the disk tier (a write, and evictions under its budget:
unlinks) and a prompt whose prefix only the disk holds is restored (a read). The same work runs twice in one engine,
first with the disk as it is, then stalled; the streams' decode steps are timed in both. The engine thread never
waits on tier I/O, so the stalled run's steps should match the first's.

    python -m kvtier.bench.stall [--streams 2] [--prompt 1024] [--stall 2] [--no-write]
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import torch

from kvtier.bench.itl import percentile
from kvtier.bench.report import (add_device_args, add_output_args, device_settings, engine_machine, header,
                                 parse_command, publish, verdict)
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.bench.throughput import random_prompts
from kvtier.bench.watch import forwards_seen
from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.tiers import disk

SECTION = "## Decode steps while the disk tier stalls"
RATIO_TARGET = 1.25      # stalled / as it is, decode-only steps at p50 and p99
STALLED_CALLS = ("read_blocks", "write_block_file", "remove")    # the disk tier's file reads, writes and unlinks


@contextlib.contextmanager
def stalled_disk(seconds: float, counts: dict[str, int]):
    """The disk tier's file reads, writes and unlinks each wait `seconds` first (counted in counts)."""
    real = {name: getattr(disk, name) for name in STALLED_CALLS}

    def slow(name):
        def call(*args, **kw):
            counts[name] += 1
            time.sleep(seconds)
            return real[name](*args, **kw)
        return call
    for name in STALLED_CALLS:
        setattr(disk, name, slow(name))
    try:
        yield
    finally:
        for name, call in real.items():
            setattr(disk, name, call)


def settle(eng: LLMEngine) -> None:
    """Until every request is done and every save has landed."""
    while eng.has_unfinished() or not eng.kv.idle():
        eng.step()
        eng.kv.wait(0.01)


def saved_history(eng: LLMEngine, args: argparse.Namespace, gen: torch.Generator) -> list[int]:
    """A prompt answered and saved to the disk tier (the only tier: the device keeps nothing for it)."""
    [history] = random_prompts(gen, 1, args.prompt, eng.model_config.vocab_size)
    eng.add_request("history", history, SamplingParams(max_tokens=1))
    settle(eng)
    return history


def run_phase(eng: LLMEngine, args: argparse.Namespace, gen: torch.Generator, history: list[int]) -> dict:
    """Streams decode; at step 4 a new prompt arrives (saved to disk: a write, and evictions), at step 8 one
    continuing `history` (restored from disk: a read). Until both are answered and `--seconds` have passed: each
    step's seconds and whether it only decoded, and the restored prompt's TTFT and cached tokens."""
    vocab = eng.model_config.vocab_size
    [fresh] = random_prompts(gen, 1, args.prompt, vocab)
    streams = [f"stream-{i}" for i in range(args.streams)]
    for rid, prompt in zip(streams, random_prompts(gen, args.streams, 64, vocab)):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=eng.max_model_len - 64, temperature=0.0, ignore_eos=True))
    decode_only = [True]

    def seen(batch):
        decode_only[0] = all(n == 1 and seq.num_computed_tokens > 0 for seq, n in zip(batch.seqs, batch.num_tokens))
    steps, finished, restore_start, ttft, cached = [], set(), None, None, None
    end = time.perf_counter() + args.seconds
    with forwards_seen(eng, seen):
        while len(finished) < 2 or time.perf_counter() < end:
            if len(steps) == 4:
                eng.add_request("fresh", fresh, SamplingParams(max_tokens=1))
            if len(steps) == 8:
                eng.add_request("restore", history + [1] * 16, SamplingParams(max_tokens=1))
                restore_start = time.perf_counter()
            decode_only[0] = False
            start = time.perf_counter()
            outputs = eng.step()
            steps.append((time.perf_counter() - start, decode_only[0]))
            for out in outputs:
                if out.finished and out.request_id in ("fresh", "restore"):
                    finished.add(out.request_id)
                if out.request_id == "restore" and out.finished:
                    ttft, cached = time.perf_counter() - restore_start, out.num_cached_tokens
    for rid in streams:
        eng.abort_request(rid)
    decodes = [s for s, only in steps if only]
    return {"decodes": decodes, "longest": max(s for s, _ in steps), "steps": len(steps), "ttft": ttft,
            "cached": cached}


def measure(args: argparse.Namespace, eng: LLMEngine) -> dict:
    gen = torch.Generator().manual_seed(0)
    results = {"as it is": run_phase(eng, args, gen, saved_history(eng, args, gen))}
    settle(eng)
    counts = dict.fromkeys(STALLED_CALLS, 0)
    history = saved_history(eng, args, gen)
    with stalled_disk(args.stall, counts):
        results["stalled"] = run_phase(eng, args, gen, history)
    settle(eng)       # what was queued behind the stall lands at the disk's own pace
    results["stalled"]["counts"] = counts
    for mode, r in results.items():
        print(f"  {mode}: {len(r['decodes'])} decode steps, p50 {percentile(r['decodes'], 0.5) * 1e3:.1f} ms, "
              f"p99 {percentile(r['decodes'], 0.99) * 1e3:.1f} ms, longest step {r['longest'] * 1e3:.0f} ms, "
              f"restore TTFT {r['ttft']:.2f} s ({r['cached']} cached)", flush=True)
    return results


def render(results: dict, args: argparse.Namespace, eng: LLMEngine, command: str) -> str:
    table = ["| disk tier | decode-only steps | p50 | p99 | max | longest step of any kind | restore TTFT (cached) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in results.items():
        d = r["decodes"]
        table.append(f"| {mode} | {len(d)} | {percentile(d, 0.5) * 1e3:.1f} ms | {percentile(d, 0.99) * 1e3:.1f} ms "
                     f"| {max(d) * 1e3:.1f} ms | {r['longest'] * 1e3:.0f} ms | {r['ttft']:.2f} s ({r['cached']}) |")
    base, stalled = results["as it is"]["decodes"], results["stalled"]["decodes"]
    ratios = [percentile(stalled, q) / percentile(base, q) for q in (0.5, 0.99)]
    counts = results["stalled"]["counts"]
    return "\n".join([
        *header(SECTION, engine_machine(eng), command),
        *table,
        "",
        "Targets:",
        "",
        f"- decode-only steps with the disk stalled ≤ {RATIO_TARGET}× those with it as it is, p50 and p99: "
        f"{verdict(max(ratios) <= RATIO_TARGET)} ({ratios[0]:.2f}× / {ratios[1]:.2f}×)",
        f"- no step of any kind waits for a stall ({args.stall:g} s): "
        f"{verdict(results['stalled']['longest'] < args.stall)} (longest {results['stalled']['longest']:.2f} s)",
        "",
        f"How: {args.streams} streams (64-token prompts) decode greedily while a new {args.prompt}-token prompt is "
        f"saved to the disk tier and another, whose {args.prompt}-token prefix the disk alone holds (host tier off, "
        f"prefix cache off), is restored; the disk's budget is small enough that saving evicts files. The same work "
        f"runs with the disk as it is, then with each of its file reads, writes and unlinks taking {args.stall:g} s "
        f"longer (in the stalled run: {counts['read_blocks']} reads, {counts['write_block_file']} writes, "
        f"{counts['remove']} unlinks stalled). Each run lasts {args.seconds:g} s, and until both prompts are "
        f"answered; a step's time is eng.step()'s, and a decode-only step is one in "
        f"which every sequence decodes one token. The restore waits for the stalled read in its own state.",
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench stall", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_device_args(p)
    p.add_argument("--streams", type=int, default=2, help="streams decoding")
    p.add_argument("--prompt", type=int, default=1024, help="tokens of the saved and the restored prompt")
    p.add_argument("--stall", type=float, default=2.0, help="seconds added to each disk read, write and unlink")
    p.add_argument("--seconds", type=float, default=15.0, help="how long each run lasts at least")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.stall", argv, parse_args)
    resolve_model(args)
    with tempfile.TemporaryDirectory(prefix="kvtier-stall-") as directory:
        eng = LLMEngine(Config(model=args.model, **device_settings(args), prefix_cache=False, kv_host_gib=0,
                               kv_disk_dir=directory, kv_pool_tokens=4 * args.prompt + args.streams * 4096))
        # room for two prompts' blocks and a little more: a third prompt's save evicts
        eng.tiers.disk.budget_bytes = int(2.2 * eng.pool.blocks_for(args.prompt) * eng.pool.block_bytes)
        print(f"stalled disk: {eng.model_name}, {eng.config.dtype}, {eng.config.device}", flush=True)
        section = render(measure(args, eng), args, eng, command)
        eng.shutdown()
    publish(section, args)


if __name__ == "__main__":
    main()
