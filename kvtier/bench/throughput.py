"""Throughput: kvtier vs Hugging Face transformers, side by side in one process.

Same model, dtype, device and thread count for both. Measures prefill tokens/s at several
prompt lengths and steady-state decode tokens/s at several batch sizes, prints a table and
writes it into docs/BENCHMARKS.md. Each number is the best of --repeats runs, and the two
engines alternate run by run so machine noise hits both alike. Decode is also set beside the
hardware's floor: the bytes one step reads (weights and every sequence's KV) over the copy
bandwidth measured in the same run. `--shape` builds a random-weight model of a real shape
offline (shapes.py); on CUDA `--hf-compile` adds transformers with a static cache and
torch.compile.

    python -m kvtier.bench.throughput [--prefill-lengths 512,2048,4096] [--no-write]
    python -m kvtier.bench.throughput --device cuda --shape llama-3.1-8b --decode-batch 1,8,32,64,128 \
        --prefill-lengths 2048,8192,32768 --hf-compile
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from kvtier.bench.report import add_output_args, cpu_model, header, int_list, parse_command, publish, verdict
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.config import DTYPES, Config, default_dtype
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.models.loader import resolve_model_path

SECTION = "## Throughput (kvtier vs transformers)"
PREFILL_TARGET = 1.0      # kvtier / transformers, at every prompt length
DECODE_B1_TARGET = 1.0    # kvtier batch 1 / transformers batch 1
DECODE_BATCH_TARGET = 4.0  # kvtier at the largest batch / transformers batch 1
FLOOR_B1_TARGET = 0.7      # kvtier batch 1 / the bandwidth floor, on a GPU


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(gen: torch.Generator, num: int, length: int, vocab_size: int) -> list[list[int]]:
    """Random token ids above the low ids, where vocabularies keep their special and byte tokens."""
    return torch.randint(vocab_size // 8, vocab_size, (num, length), generator=gen).tolist()


# --- kvtier -------------------------------------------------------------------------------------

def kvtier_prefill(eng: LLMEngine, prompt: list[int], request_id: str) -> float:
    """Seconds from add_request to the first token (max_tokens=1: the request ends with it)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    eng.add_request(request_id, prompt, params)
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - start


def kvtier_decode(eng: LLMEngine, prompts: list[list[int]], num_tokens: int, tag: str) -> float:
    """Tokens/s from the moment every request has its first token until all have finished."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", prompt, params)
    started, start, produced = set(), None, 0
    while eng.has_unfinished():
        outputs = eng.step()
        if start is not None:
            produced += sum(len(o.new_token_ids) for o in outputs)
        started.update(o.request_id for o in outputs if o.num_output_tokens > 0)
        if start is None and len(started) == len(prompts):
            start = time.perf_counter()
    return produced / (time.perf_counter() - start)


# --- transformers -------------------------------------------------------------------------------

@torch.inference_mode()
def hf_compiled_decode(model, prompts: list[list[int]], num_tokens: int, device: torch.device) -> float:
    """Tokens/s of a greedy loop over a static cache with the forward compiled (torch.compile, CUDA graphs): the
    fastest way transformers decodes."""
    from transformers import StaticCache
    batch, length = len(prompts), len(prompts[0])
    cache = StaticCache(config=model.config, max_cache_len=length + num_tokens)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    positions = torch.arange(length, device=device)
    logits = model(torch.tensor(prompts, device=device), past_key_values=cache, cache_position=positions,
                   use_cache=True, logits_to_keep=1).logits
    next_tokens = logits[:, -1].argmax(-1, keepdim=True)
    for warm in range(3):     # compile and record the graphs outside the timing
        step(next_tokens, past_key_values=cache, cache_position=positions[-1:] + 1 + warm, use_cache=True)
    cache.reset()
    model(torch.tensor(prompts, device=device), past_key_values=cache, cache_position=positions, use_cache=True,
          logits_to_keep=1)
    sync(device)
    start = time.perf_counter()
    for i in range(num_tokens - 1):
        logits = step(next_tokens, past_key_values=cache, cache_position=positions[-1:] + 1 + i, use_cache=True).logits
        next_tokens = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return batch * (num_tokens - 1) / (time.perf_counter() - start)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes/s one device copy moves (read plus write), the best of 5: what bounds reading weights and KV."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def read_bytes_per_step(hf, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """What one decode step must read: the weights but an untied input embedding (only its rows are read), and
    each sequence's KV at the given context."""
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    embedding, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    if embedding.data_ptr() != head.data_ptr():
        weights -= embedding.numel() * embedding.element_size()
    return weights + batch * context * kv_bytes_per_token


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def hf_prefill(model, prompt: list[int], device: torch.device) -> float:
    """Seconds for one forward over the prompt that builds the cache, as generate's first step does."""
    from transformers import DynamicCache
    ids = torch.tensor([prompt], device=device)
    sync(device)
    start = time.perf_counter()
    logits = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1).logits
    logits[:, -1].argmax(-1).tolist()
    return time.perf_counter() - start


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], num_tokens: int, device: torch.device) -> float:
    """Tokens/s of a greedy loop over a DynamicCache, after the prefill that gives the first token."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor(prompts, device=device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    next_tokens = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    start = time.perf_counter()
    for _ in range(num_tokens - 1):
        logits = model(next_tokens, past_key_values=cache, use_cache=True).logits
        next_tokens = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return len(prompts) * (num_tokens - 1) / (time.perf_counter() - start)


# --- the run ------------------------------------------------------------------------------------

def measure(args: argparse.Namespace, eng: LLMEngine, hf, device: torch.device) -> dict:
    """{"prefill": {length: (kvtier, hf)}, "decode": {batch: (kvtier, hf)}} in tokens/s."""
    vocab, gen = eng.model_config.vocab_size, torch.Generator().manual_seed(0)
    ctx, n = args.decode_context, args.decode_tokens
    # warm-up: one short prefill and one short decode at the largest batch, on each side
    warm = random_prompts(gen, max(args.decode_batch), ctx, vocab)
    kvtier_prefill(eng, warm[0], "warm-prefill")
    kvtier_decode(eng, warm, 4, "warm-decode")
    hf_prefill(hf, warm[0], device)
    hf_decode(hf, warm, 4, device)

    prefill = {length: [float("inf"), float("inf")] for length in args.prefill_lengths}
    decode = {batch: [0.0, 0.0] for batch in args.decode_batch}
    compiled = dict.fromkeys(args.decode_batch, 0.0) if args.hf_compile else {}
    for rep in range(args.repeats):
        for length in args.prefill_lengths:
            # a fresh prompt per run, so the prefix cache never serves it; the same tokens for both
            [prompt] = random_prompts(gen, 1, length, vocab)
            best = prefill[length]
            best[0] = min(best[0], kvtier_prefill(eng, prompt, f"prefill-{rep}-{length}"))
            best[1] = min(best[1], hf_prefill(hf, prompt, device))
            print(f"  repeat {rep + 1}: prefill {length}: kvtier {length / best[0]:.0f} tok/s, "
                  f"transformers {length / best[1]:.0f} tok/s (best so far)", flush=True)
        for batch in args.decode_batch:
            prompts = random_prompts(gen, batch, ctx, vocab)
            best = decode[batch]
            best[0] = max(best[0], kvtier_decode(eng, prompts, n, f"decode-{rep}-{batch}"))
            best[1] = max(best[1], hf_decode(hf, prompts, n, device))
            if args.hf_compile:
                compiled[batch] = max(compiled[batch], hf_compiled_decode(hf, prompts, n, device))
            print(f"  repeat {rep + 1}: decode b={batch}: kvtier {best[0]:.1f} tok/s, "
                  f"transformers {best[1]:.1f} tok/s (best so far)", flush=True)
    bandwidth = copy_bandwidth(device)
    # the floor at the mean context of the timed steps
    context = ctx + n // 2
    kv_per_token = eng.pool.block_bytes // eng.pool.block_size
    floor = {batch: batch * bandwidth / read_bytes_per_step(hf, batch, context, kv_per_token)
             for batch in args.decode_batch}
    return {"prefill": {length: (length / kv, length / ref) for length, (kv, ref) in prefill.items()},
            "decode": {batch: tuple(tps) for batch, tps in decode.items()}, "compiled": compiled,
            "floor": floor, "bandwidth": bandwidth}


def render(results: dict, args: argparse.Namespace, eng: LLMEngine, command: str) -> str:
    import transformers
    prefill, decode = results["prefill"], results["decode"]
    chunk = eng.config.max_batched_tokens
    big = max(decode)
    rows = []
    for length, (kv, ref) in prefill.items():
        chunks = -(-length // chunk)
        note = f"; kvtier runs {chunks} chunks of ≤{chunk}" if chunks > 1 else ""
        rows.append((f"prefill@{length} (tok/s{note})", kv, ref))
    for batch, (kv, ref) in decode.items():
        rows.append((f"decode b={batch} (tok/s)", kv, ref))
    if big != 1 and 1 in decode:
        rows.append((f"decode kvtier b={big} vs transformers b=1 (tok/s)", decode[big][0], decode[1][1]))
    table = ["| metric | kvtier | transformers | ratio |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {name} | {kv:.1f} | {ref:.1f} | {kv / ref:.2f}× |" for name, kv, ref in rows]

    table += ["", "Decode beside the hardware floor (the bytes a step reads over the copy bandwidth "
              f"{results['bandwidth'] / 1e9:.1f} GB/s measured in this run)"
              + (" and transformers with a static cache and torch.compile:" if results["compiled"] else ":"), "",
              "| batch | kvtier (tok/s) | floor (tok/s) | kvtier / floor |"
              + (" transformers compiled (tok/s) | kvtier / compiled |" if results["compiled"] else ""),
              "| ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if results["compiled"] else "")]
    for batch, (kv, _) in decode.items():
        floor = results["floor"][batch]
        row = f"| {batch} | {kv:.1f} | {floor:.1f} | {kv / floor:.0%} |"
        if results["compiled"]:
            row += f" {results['compiled'][batch]:.1f} | {kv / results['compiled'][batch]:.2f}× |"
        table.append(row)
    prefill_ratios = {length: kv / ref for length, (kv, ref) in prefill.items()}
    targets = [f"- prefill ≥ {PREFILL_TARGET:.1f}× transformers at every length: "
               f"{verdict(all(r >= PREFILL_TARGET for r in prefill_ratios.values()))} ("
               + ", ".join(f"{length}: {r:.2f}×" for length, r in prefill_ratios.items()) + ")"]
    if args.device.startswith("cuda") and 1 in decode:
        share = decode[1][0] / results["floor"][1]
        targets.append(f"- batch-1 decode ≥ {FLOOR_B1_TARGET:.0%} of the floor (CUDA): "
                       f"{verdict(share >= FLOOR_B1_TARGET)} ({share:.0%})")
    if results["compiled"]:
        worst = min(decode[b][0] / results["compiled"][b] for b in decode)
        targets.append(f"- decode ≥ transformers with a static cache and torch.compile at every batch: "
                       f"{verdict(worst >= 1.0)} (lowest {worst:.2f}×)")
    if 1 in decode:
        b1 = decode[1][0] / decode[1][1]
        targets.append(f"- batch-1 decode ≥ {DECODE_B1_TARGET:.1f}× transformers: "
                       f"{verdict(b1 >= DECODE_B1_TARGET)} ({b1:.2f}×)")
        if big != 1:
            bb = decode[big][0] / decode[1][1]
            targets.append(f"- batch-{big} decode throughput ≥ {DECODE_BATCH_TARGET:.0f}× transformers' batch-1: "
                           f"{verdict(bb >= DECODE_BATCH_TARGET)} ({bb:.2f}×)")

    machine = (f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, transformers "
               f"{transformers.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
               f"{eng.config.dtype}, model {eng.model_name}, kvtier decode "
               + (f"from CUDA graphs (batch buckets {eng.runner.graphs.buckets})" if eng.runner.graphs else "eager"))
    return "\n".join([
        *header(SECTION, machine, command),
        *table,
        "",
        "Targets:",
        "",
        *targets,
        "",
        f"How: both engines in one process, alternating run by run; each number is the best of "
        f"{args.repeats} runs after a warm-up. kvtier runs with its prefix cache and tiers off, so every "
        f"number is computed KV, never restored (the TTFT section measures reuse). Prefill: random-token "
        f"prompts, a fresh one per run, the same tokens for both; kvtier is "
        f"timed from add_request to the first token with the default max_batched_tokens={chunk} (longer prompts "
        f"run as several chunks, as users get them); transformers is one forward with a DynamicCache and "
        f"logits_to_keep=1, as generate's first step. Decode: {args.decode_context}-token prompts, "
        f"{args.decode_tokens} greedy tokens each (ignore_eos); kvtier adds all requests at once and is timed "
        f"from when every request has its first token until all finish; transformers runs a manual loop of "
        f"forward + argmax over a DynamicCache (equal-length prompts, no padding), timed over the loop only. "
        f"Both count the {args.decode_tokens - 1} tokens per sequence after the first.",
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench throughput", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both engines")
    p.add_argument("--prefill-lengths", type=int_list, default=[512, 2048, 4096], help="comma-separated")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--decode-batch", type=int_list, default=[1, 8], help="comma-separated batch sizes")
    p.add_argument("--decode-context", type=int, default=128, help="prompt length of the decode runs")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the best is reported")
    p.add_argument("--enforce-eager", action="store_true", help="kvtier's decode without CUDA graphs (CUDA)")
    p.add_argument("--hf-compile", action="store_true",
                   help="also measure transformers' decode with a static cache and torch.compile (CUDA)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token comes from the prefill)")
    return args


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.throughput", argv, parse_args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.dtype = args.dtype or default_dtype(args.device)
    resolve_model(args)
    batch = max(args.decode_batch)
    need = max(max(args.prefill_lengths) + 1, batch * (args.decode_context + args.decode_tokens))
    # raw compute: no prefix cache and no tiers, so no run can reuse another's (or an earlier process's) KV
    eng = LLMEngine(Config(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                           kv_pool_tokens=need + 64 * batch, max_num_seqs=batch,
                           prefix_cache=False, kv_host_gib=0, kv_disk=False, enforce_eager=args.enforce_eager))
    hf = load_hf(resolve_model_path(args.model), DTYPES[args.dtype], device)
    print(f"kvtier vs transformers: {eng.model_name}, {args.dtype}, {args.device}, {args.threads} threads", flush=True)
    section = render(measure(args, eng, hf, device), args, eng, command)
    publish(section, args)


if __name__ == "__main__":
    main()
