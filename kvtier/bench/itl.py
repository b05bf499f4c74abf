"""Inter-token latency of running streams while a long prompt prefills, with and without pacing.

Some streams decode; their inter-token latency is measured alone, then while a long prompt
arrives and prefills beside them, then alone again (their contexts grow meanwhile), in the same
engine: once with the pacer bounding the steps
(`--max-itl-ratio`, the server's default), once without (prompt chunks of `max_batched_tokens`,
as before pacing). The long prompt's time to first token is reported for both, since pacing
trades it for the streams' pace.

    python -m kvtier.bench.itl [--streams 4] [--long-prompt 8000] [--no-write]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvtier.bench.report import (add_device_args, add_output_args, device_settings, engine_machine, header,
                                 parse_command, publish, verdict)
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.bench.throughput import random_prompts
from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams

SECTION = "## Inter-token latency during a long prefill"
ITL_TARGET = 3.0     # streams' inter-token latency during the prefill / alone, at p50 and p99


def milliseconds(values: list[float]) -> str:
    return " / ".join(f"{x * 1e3:.0f}" for x in values) + " ms"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_phase(eng: LLMEngine, last: dict[str, float | None], long_prompt: list[int] | None, tokens: int,
                  tag: str) -> tuple[list[float], float | None]:
    """Step while the streams decode: with no long prompt, until each has `tokens` more tokens; with one, until
    it has its first token. last: each stream's last token's time (None before its first), carried from phase to
    phase, so the gap the long prompt's arrival opens counts. Returns the streams' inter-token gaps (seconds) in
    this phase and the long prompt's TTFT."""
    gaps, counts, ttft = [], dict.fromkeys(last, 0), None
    start = time.perf_counter()
    if long_prompt is not None:
        eng.add_request(tag, long_prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        outputs = eng.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == tag:
                ttft = now - start
            elif out.request_id in last and out.new_token_ids:
                if last[out.request_id] is not None:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
                counts[out.request_id] += 1
        done = ttft is not None if long_prompt is not None else min(counts.values()) > tokens
        if done:
            return gaps, ttft


# a stream's prompt and output tokens: room in the pool for more than it decodes while both long prompts prefill
STREAM_TOKENS = 4096


def measure(args: argparse.Namespace, eng: LLMEngine) -> dict:
    vocab, gen = eng.model_config.vocab_size, torch.Generator().manual_seed(0)
    streams = [f"stream-{i}" for i in range(args.streams)]
    params = SamplingParams(max_tokens=STREAM_TOKENS - args.stream_prompt, temperature=0.0, ignore_eos=True)
    for rid, prompt in zip(streams, random_prompts(gen, args.streams, args.stream_prompt, vocab)):
        eng.add_request(rid, prompt, params)
    pacer = eng.scheduler.pacer
    paced_ratio = pacer.max_itl_ratio
    results, last = {}, dict.fromkeys(streams)
    measure_phase(eng, last, None, 8, "warm-up")
    for mode, ratio in (("paced", paced_ratio), ("unpaced", 0)):
        pacer.max_itl_ratio = ratio
        before, _ = measure_phase(eng, last, None, args.alone_tokens, "")
        [long_prompt] = random_prompts(gen, 1, args.long_prompt, vocab)
        during, ttft = measure_phase(eng, last, long_prompt, 0, f"long-{mode}")
        after, _ = measure_phase(eng, last, None, args.alone_tokens, "")
        results[mode] = {"before": before, "after": after, "during": during, "ttft": ttft, "ratio": ratio}
        print(f"  {mode}: alone p50 {percentile(before, 0.5) * 1e3:.0f} ms before, "
              f"{percentile(after, 0.5) * 1e3:.0f} ms after, during p50 {percentile(during, 0.5) * 1e3:.0f} ms "
              f"p99 {percentile(during, 0.99) * 1e3:.0f} ms, long TTFT {ttft:.1f} s", flush=True)
    for rid in streams:
        eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    return results


def render(results: dict, args: argparse.Namespace, eng: LLMEngine, command: str) -> str:
    table = ["| mode | alone before the prefill p50 / p99 / mean | alone after it p50 / p99 / mean "
             "| during the prefill p50 / p99 / mean | during / alone p50 / p99 / mean | long prompt TTFT |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ratios = {}
    for mode, r in results.items():
        before, after, during = ([percentile(r[phase], q) for q in (0.5, 0.99)] + [statistics.mean(r[phase])]
                                 for phase in ("before", "after", "during"))
        alone = [(b + a) / 2 for b, a in zip(before, after)]     # idle at the contexts midway through the prefill
        ratios[mode] = [d / a for d, a in zip(during, alone)]
        label = f"paced (--max-itl-ratio {r['ratio']:g})" if r["ratio"] else "unpaced (--max-itl-ratio 0)"
        table.append(f"| {label} | {milliseconds(before)} | {milliseconds(after)} | {milliseconds(during)} | "
                     f"{' / '.join(f'{x:.1f}×' for x in ratios[mode])} | {r['ttft']:.1f} s |")
    paced = ratios["paced"]
    paced_before = [percentile(results["paced"]["during"], q) / percentile(results["paced"]["before"], q)
                    for q in (0.5, 0.99)]
    slower = results["paced"]["ttft"] / results["unpaced"]["ttft"]
    return "\n".join([
        *header(SECTION, engine_machine(eng), command),
        *table,
        "",
        "Targets:",
        "",
        f"- paced streams' inter-token latency during the prefill ≤ {ITL_TARGET:.0f}× alone, p50 and p99: "
        f"{verdict(max(paced[:2]) <= ITL_TARGET)} ({paced[0]:.1f}× / {paced[1]:.1f}×)",
        f"- paced streams' mean inter-token latency during the prefill ≤ --max-itl-ratio × alone: "
        f"{verdict(paced[2] <= results['paced']['ratio'])} ({paced[2]:.1f}×)",
        "",
        f"How: {args.streams} streams with {args.stream_prompt}-token prompts decode greedily; their gaps between "
        f"tokens are measured over {args.alone_tokens} tokens each alone, then while a {args.long_prompt}-token "
        f"prompt (random tokens, a fresh one per mode) prefills beside them, until its first token, then alone "
        f"again. A stream's step gets slower as its context grows, and its contexts during the prefill lie between "
        f"those before and after it, so its idle latency is the mean of the two alone phases' (each percentile "
        f"apart); against the phase before the prefill alone, the paced ratios would be {paced_before[0]:.1f}× / "
        f"{paced_before[1]:.1f}×. Where a prompt chunk's fixed cost is over half a step's allowance (CPU with "
        f"quantized weights), the pacer holds the streams' mean, not each step: its chunks run past the allowance "
        f"and decode-only steps pay them back, so p99 is a chunk's step. Both modes run "
        f"in one engine, paced first; the streams' context grows between them. Pacing costs the long prompt "
        f"{slower:.2f}× its unpaced TTFT here. Prefix cache and tiers are off: every token is computed.",
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench itl", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_device_args(p)
    p.add_argument("--streams", type=int, default=4, help="streams decoding")
    p.add_argument("--stream-prompt", type=int, default=128, help="prompt tokens of each stream")
    p.add_argument("--long-prompt", type=int, default=8000, help="tokens of the prompt that prefills beside them")
    p.add_argument("--alone-tokens", type=int, default=16, help="tokens per stream measured alone")
    p.add_argument("--max-batched-tokens", type=int, default=None, help="the engine's per-step budget")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.itl", argv, parse_args)
    resolve_model(args)
    extra = {"max_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}
    eng = LLMEngine(Config(model=args.model, **device_settings(args), **extra, prefix_cache=False, kv_host_gib=0,
                           kv_disk=False, kv_pool_tokens=args.long_prompt + args.streams * STREAM_TOKENS + 1024))
    if args.long_prompt + 1 > eng.max_model_len:
        sys.exit(f"--long-prompt must stay under the model's context ({eng.max_model_len})")
    print(f"inter-token latency: {eng.model_name}, {eng.config.dtype}, {eng.config.device}", flush=True)
    section = render(measure(args, eng), args, eng, command)
    publish(section, args)


if __name__ == "__main__":
    main()
