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
import contextlib
import os
import resource
import time

import torch

from kvtier.bench import llama_cpp
from kvtier.bench.report import (add_kv_cache_dtype_arg, add_output_args, header, int_list, parse_command, processors,
                                 publish, verdict)
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.config import DTYPES, QUANTIZE_MODES, Config, default_dtype
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.models.choice import sync, timed
from kvtier.models.decoder import Decoder
from kvtier.models.ggml_decoder import GgmlDecodeSteps
from kvtier.models.gguf_file import GGUFFile
from kvtier.models.int4pack import described
from kvtier.models.loader import resolve_model_path
from kvtier.models.quantized import model_weight_bytes, prompt_dtype

SECTION = "## Throughput (kvtier vs transformers)"
PREFILL_TARGET = 1.0      # kvtier / transformers, at every prompt length
DECODE_B1_TARGET = 1.0    # kvtier batch 1 / transformers batch 1
DECODE_BATCH_TARGET = 4.0  # kvtier at the largest batch / transformers batch 1
FLOOR_B1_TARGET = 0.7      # kvtier batch 1 / the bandwidth floor, on a GPU
DECODE_CONTEXT = 128       # the decode runs' prompt length, unless --decode-context says otherwise
LLAMA_DECODE_TARGET = 1.0   # kvtier batch 1 / llama.cpp batch 1, same GGUF file
LLAMA_PREFILL_TARGET = 1.2  # kvtier / llama.cpp prefill at 2048 and 4096 tokens
MEMORY_TARGET = 1.2         # kvtier's weights in memory / a GGUF file's tensor bytes
QUANTIZED_GPU_TARGET = 2.0  # kvtier batch 1 with quantized weights / with bfloat16 weights, on CUDA
# seconds between two engines' runs: the threads of the one that ran (llama.cpp's poll for work, torch's spin after
# a parallel region) go idle before the next is timed on the same cores
PAUSE = 0.3


def random_prompts(gen: torch.Generator, num: int, length: int, vocab_size: int) -> list[list[int]]:
    """Random token ids above the low ids, where vocabularies keep their special and byte tokens."""
    return torch.randint(vocab_size // 8, vocab_size, (num, length), generator=gen).tolist()


# --- kvtier -------------------------------------------------------------------------------------

def first_token(eng: LLMEngine, prompt: list[int], request_id: str) -> tuple[float, int]:
    """Seconds from add_request to the first token (max_tokens=1: the request ends with it), and the prompt tokens
    the cache held."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    eng.add_request(request_id, prompt, params)
    cached = 0
    while eng.has_unfinished():
        for out in eng.step():
            cached = out.num_cached_tokens
    return time.perf_counter() - start, cached


def kvtier_decode(eng: LLMEngine, prompts: list[list[int]], num_tokens: int, tag: str,
                  while_timed=contextlib.nullcontext) -> float:
    """Tokens/s from the moment every request has its first token until all have finished (inside while_timed(): a
    profiler, say, which then sees decode steps only)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", prompt, params)
    started, start, produced = set(), None, 0
    with contextlib.ExitStack() as timed:
        while eng.has_unfinished():
            outputs = eng.step()
            if start is not None:
                produced += sum(len(o.new_token_ids) for o in outputs)
            started.update(o.request_id for o in outputs if o.num_output_tokens > 0)
            if start is None and len(started) == len(prompts):
                timed.enter_context(while_timed())
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
    return 2 * nbytes / timed([lambda: dst.copy_(src)], device, repeats=5)


def read_bytes_per_step(model: Decoder, batch: int, context: int, kv_bytes_per_token: int) -> int:
    """What one decode step must read: kvtier's weights (as it keeps them) but an untied input embedding (only its
    rows are read), and each sequence's KV at the given context."""
    untied = 0 if model.config.tie_word_embeddings else model_weight_bytes(model.model.embed_tokens)
    return model_weight_bytes(model) - untied + batch * context * kv_bytes_per_token


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

def contestants(eng: LLMEngine, float_eng: LLMEngine | None, hf, llama: llama_cpp.LlamaCpp | None,
                device: torch.device) -> dict[str, tuple]:
    """name → (prefill(prompt, tag) → seconds, decode(prompts, tokens, tag) → tokens/s), kvtier first."""
    def kvtier(e):
        return (lambda prompt, tag: first_token(e, prompt, tag)[0],
                lambda prompts, n, tag: kvtier_decode(e, prompts, n, tag))
    found = {"kvtier": kvtier(eng)}
    if float_eng is not None:
        found[f"kvtier {float_eng.config.dtype}"] = kvtier(float_eng)
    if hf is not None:
        found["transformers"] = (lambda prompt, tag: hf_prefill(hf, prompt, device),
                                 lambda prompts, n, tag: hf_decode(hf, prompts, n, device))
    if llama is not None:
        found["llama.cpp"] = (lambda prompt, tag: llama.prefill(prompt),
                              lambda prompts, n, tag: llama.decode(prompts, n))
    return found


def measure(args: argparse.Namespace, eng: LLMEngine, players: dict[str, tuple], hf, device: torch.device) -> dict:
    """{"prefill": {length: {name: tok/s}}, "decode": {batch: {name: tok/s}}, ...}."""
    vocab, gen = eng.model_config.vocab_size, torch.Generator().manual_seed(0)
    ctx, n = args.decode_context, args.decode_tokens
    # warm-up: one short prefill and one short decode at the largest batch, on each side
    warm = random_prompts(gen, max(args.decode_batch), ctx, vocab)
    for name, (prefill_fn, decode_fn) in players.items():
        prefill_fn(warm[0], f"warm-prefill-{name}")
        decode_fn(warm, 4, f"warm-decode-{name}")

    prefill = {length: dict.fromkeys(players, 0.0) for length in args.prefill_lengths}
    decode = {batch: dict.fromkeys(players, 0.0) for batch in args.decode_batch}
    compiled = dict.fromkeys(args.decode_batch, 0.0) if args.hf_compile else {}
    decode_prompts = []
    for rep in range(args.repeats):
        for length in args.prefill_lengths:
            # a fresh prompt per run, so the prefix cache never serves it; the same tokens for all
            [prompt] = random_prompts(gen, 1, length, vocab)
            for name, (prefill_fn, _) in players.items():
                prefill[length][name] = max(prefill[length][name], length / prefill_fn(prompt, f"p-{rep}-{length}"))
                time.sleep(PAUSE)
            print(f"  repeat {rep + 1}: prefill {length} tok/s (best so far): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in prefill[length].items()), flush=True)
        for batch in args.decode_batch:
            prompts = random_prompts(gen, batch, ctx, vocab)
            decode_prompts.append((batch, prompts))
            for name, (_, decode_fn) in players.items():
                decode[batch][name] = max(decode[batch][name], decode_fn(prompts, n, f"d-{rep}-{batch}"))
                time.sleep(PAUSE)
            print(f"  repeat {rep + 1}: decode b={batch} tok/s (best so far): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in decode[batch].items()), flush=True)
    # transformers compiled last: after its CUDA graph trees ran, the next replay of kvtier's own graphs in this
    # process failed ("unspecified launch failure", H100, torch 2.11)
    for batch, prompts in decode_prompts if args.hf_compile else ():
        compiled[batch] = max(compiled[batch], hf_compiled_decode(hf, prompts, n, device))
    bandwidth = copy_bandwidth(device)
    # the floor at the mean context of the timed steps
    context = ctx + n // 2
    kv_per_token = eng.pool.block_bytes // eng.pool.block_size
    floor = {batch: batch * bandwidth / read_bytes_per_step(eng.model, batch, context, kv_per_token)
             for batch in args.decode_batch}
    return {"prefill": prefill, "decode": decode, "compiled": compiled, "floor": floor, "bandwidth": bandwidth}


def render(results: dict, args: argparse.Namespace, eng: LLMEngine, command: str) -> str:
    import transformers
    prefill, decode = results["prefill"], results["decode"]
    names = list(next(iter(decode.values())))
    others = names[1:]
    chunk = eng.config.max_batched_tokens
    big = max(decode)
    rows = []
    for length, tps in prefill.items():
        chunks = -(-length // chunk)
        note = f"; kvtier runs {chunks} chunks of ≤{chunk}" if chunks > 1 else ""
        rows.append((f"prefill@{length} (tok/s{note})", tps))
    for batch, tps in decode.items():
        rows.append((f"decode b={batch} (tok/s)", tps))
    table = ["| metric | " + " | ".join(names) + " | " + " | ".join(f"kvtier / {o}" for o in others) + " |",
             "| --- |" + " ---: |" * (2 * len(names) - 1)]
    table += [f"| {metric} | " + " | ".join(f"{tps[k]:.1f}" for k in names) + " | "
              + " | ".join(f"{tps['kvtier'] / tps[o]:.2f}×" for o in others) + " |" for metric, tps in rows]

    table += ["", "kvtier's decode beside the hardware floor (the bytes a step reads, kvtier's weights and KV, over "
              f"the copy bandwidth {results['bandwidth'] / 1e9:.1f} GB/s measured in this run)"
              + (" and transformers with a static cache and torch.compile:" if results["compiled"] else ":"), "",
              "| batch | kvtier (tok/s) | floor (tok/s) | kvtier / floor |"
              + (" transformers compiled (tok/s) | kvtier / compiled |" if results["compiled"] else ""),
              "| ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if results["compiled"] else "")]
    for batch, tps in decode.items():
        kv, floor = tps["kvtier"], results["floor"][batch]
        row = f"| {batch} | {kv:.1f} | {floor:.1f} | {kv / floor:.0%} |"
        if results["compiled"]:
            row += f" {results['compiled'][batch]:.1f} | {kv / results['compiled'][batch]:.2f}× |"
        table.append(row)
    targets = []
    if "transformers" in names:
        targets.append(target(f"prefill ≥ {PREFILL_TARGET:.1f}× transformers at every length",
                              {length: tps["kvtier"] / tps["transformers"] for length, tps in prefill.items()},
                              PREFILL_TARGET))
    if "llama.cpp" in names:
        targets.append(target(f"batch-1 decode ≥ {LLAMA_DECODE_TARGET:.1f}× llama.cpp's",
                              {1: decode[1]["kvtier"] / decode[1]["llama.cpp"]} if 1 in decode else {},
                              LLAMA_DECODE_TARGET))
        targets.append(target(f"prefill ≥ {LLAMA_PREFILL_TARGET:.1f}× llama.cpp's at 2048 and 4096",
                              {length: tps["kvtier"] / tps["llama.cpp"] for length, tps in prefill.items()
                               if length >= 2048}, LLAMA_PREFILL_TARGET))
    if results["file_tensor_bytes"] and eng.model.quantized:
        targets.append(target(f"weights in memory ≤ {MEMORY_TARGET:.1f}× the GGUF's tensors",
                              {"weights / file": model_weight_bytes(eng.model) / results["file_tensor_bytes"]},
                              MEMORY_TARGET, above=False))
    dequantized = f"kvtier {eng.config.dtype}"      # kvtier with every weight in dtype, beside quantized ones
    if dequantized in names and args.device == "cpu":
        targets.append(target("prefill no slower than with float32 weights",
                              {length: tps["kvtier"] / tps[dequantized] for length, tps in prefill.items()},
                              1.0))
    if dequantized in names and args.device.startswith("cuda"):
        targets.append(target(f"batch-1 decode with quantized weights ≥ {QUANTIZED_GPU_TARGET:.0f}× with "
                              f"{eng.config.dtype} weights (CUDA)",
                              {1: decode[1]["kvtier"] / decode[1][dequantized]} if 1 in decode else {},
                              QUANTIZED_GPU_TARGET))
    if args.device.startswith("cuda") and 1 in decode:
        share = decode[1]["kvtier"] / results["floor"][1]
        targets.append(f"- batch-1 decode ≥ {FLOOR_B1_TARGET:.0%} of the floor (CUDA): "
                       f"{verdict(share >= FLOOR_B1_TARGET)} ({share:.0%})")
    if results["compiled"]:
        worst = min(decode[b]["kvtier"] / results["compiled"][b] for b in decode)
        targets.append(f"- decode ≥ transformers with a static cache and torch.compile at every batch: "
                       f"{verdict(worst >= 1.0)} (lowest {worst:.2f}×)")
    if 1 in decode and "transformers" in names:
        targets.append(target(f"batch-1 decode ≥ {DECODE_B1_TARGET:.1f}× transformers",
                              {1: decode[1]["kvtier"] / decode[1]["transformers"]}, DECODE_B1_TARGET))
        if big != 1:
            targets.append(target(f"batch-{big} decode throughput ≥ {DECODE_BATCH_TARGET:.0f}× transformers' "
                                  "batch-1", {big: decode[big]["kvtier"] / decode[1]["transformers"]},
                                  DECODE_BATCH_TARGET))

    graphs = eng.runner.graphs
    decode_path = ("eager" if graphs is None else "one ggml graph per step" if isinstance(graphs, GgmlDecodeSteps)
                   else f"CUDA graphs (batch buckets {graphs.buckets})")
    prompt = prompt_dtype(eng.config.torch_dtype, torch.device(args.device).type)
    prompt_rows = f", prompt rows in {str(prompt).removeprefix('torch.')}" if prompt != eng.config.torch_dtype else ""
    size = model_weight_bytes(eng.model) / 1e6
    weights = (f"weights as stored ({size:.0f} MB{prompt_rows}{decode_products(eng.model)})"
               if eng.model.quantized else f"{eng.config.dtype} weights")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    machine = (f"{processors(args.device)}, {os.cpu_count()} cores, torch {torch.__version__}, transformers "
               f"{transformers.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
               f"{eng.config.dtypes}, model {eng.model_name}, kvtier with {weights}, decode {decode_path}; the "
               f"process's peak RSS {peak:.1f} GiB (every engine in it)")
    batching = ("its prefill and each decode step run in batches cut to the rows below" if results["llama_rows"] else
                "its prefill runs in its own micro-batches, its decode is one batch of every sequence per step")
    llama_note = ("llama.cpp is ik_llama.cpp (a fork with faster CPU kernels) through the prebuilt ik-llama-cpp-python "
                  "wheel, on the same file and threads, flash attention "
                  + ("on" if results["llama_flash"] else "off (the wheel turns it off without AVX-VNNI)")
                  + f"; {batching}, with greedy argmax." + results["llama_rows"]
                  if "llama.cpp" in names else results["llama_missing"])
    # a shape's numbers, and decodes over longer contexts, in sections of their own beside the bundled model's
    qualifiers = ([args.shape] if args.shape else []) + ([f"decode at {args.decode_context} tokens of context"]
                                                         if args.decode_context > DECODE_CONTEXT else [])
    return "\n".join([
        *header(SECTION[:-1] + "".join(f", {q}" for q in qualifiers) + ")", machine, command),
        *table,
        "",
        "Targets:",
        "",
        *targets,
        "",
        f"How: every engine in one process, alternating run by run; each number is the best of "
        f"{args.repeats} runs after a warm-up. kvtier runs with its prefix cache and tiers off, so every "
        f"number is computed KV, never restored (the TTFT section measures reuse), and without pacing (a batch's "
        f"prompts prefill whole before its decode is timed). Prefill: random-token "
        f"prompts, a fresh one per run, the same tokens for all; kvtier is "
        f"timed from add_request to the first token with the default max_batched_tokens={chunk} (longer prompts "
        f"run as several chunks, as users get them); transformers is one forward with a DynamicCache and "
        f"logits_to_keep=1, as generate's first step. Decode: {args.decode_context}-token prompts, "
        f"{args.decode_tokens} greedy tokens each (ignore_eos); kvtier adds all requests at once and is timed "
        f"from when every request has its first token until all finish; transformers runs a manual loop of "
        f"forward + argmax over a DynamicCache (equal-length prompts, no padding), timed over the loop only. "
        f"All count the {args.decode_tokens - 1} tokens per sequence after the first. {llama_note}",
        "",
    ])


def target(what: str, ratios: dict, wanted: float, above: bool = True) -> str:
    if not ratios:
        return f"- {what}: not measured"
    met = all(r >= wanted if above else r <= wanted for r in ratios.values())
    return (f"- {what}: {verdict(met)} ("
            + ", ".join(f"{k}: {r:.2f}×" for k, r in ratios.items()) + ")")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench throughput", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="cpu")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for both engines")
    p.add_argument("--prefill-lengths", type=int_list, default=[512, 2048, 4096], help="comma-separated")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--decode-batch", type=int_list, default=[1, 8, 32], help="comma-separated batch sizes")
    p.add_argument("--quantize", default="auto", choices=QUANTIZE_MODES,
                   help="kvtier's weights (kvtier serve --quantize)")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers out (a 7B model in float32)")
    p.add_argument("--no-float", action="store_true",
                   help="leave out kvtier with every weight in --dtype beside quantized ones (a 7B model's "
                        "float32 weights take 28 GB)")
    p.add_argument("--decode-context", type=int, default=DECODE_CONTEXT, help="prompt length of the decode runs")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the best is reported")
    p.add_argument("--enforce-eager", action="store_true", help="kvtier's decode without CUDA graphs (CUDA)")
    p.add_argument("--hf-compile", action="store_true",
                   help="also measure transformers' decode with a static cache and torch.compile (CUDA)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="after the measurements, profile kvtier's decode at the smallest --decode-batch with torch's "
                        "profiler and write its ops and kernels by self time to FILE")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.hf_compile and args.no_transformers:
        p.error("--hf-compile measures transformers: it cannot go with --no-transformers")
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
    # raw compute: no prefix cache and no tiers, so no run can reuse another's (or an earlier process's) KV; no
    # pacing, so that a batch's prompts all prefill before its decode is timed, every sequence in every step
    def engine(quantize: str) -> LLMEngine:
        return LLMEngine(Config(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                                kv_cache_dtype=args.kv_cache_dtype, kv_pool_tokens=need + 64 * batch,
                                max_num_seqs=batch, quantize=quantize, max_itl_ratio=0,
                                prefix_cache=False, kv_host_gib=0, kv_disk=False, enforce_eager=args.enforce_eager))
    eng = engine(args.quantize)
    # beside kvtier on quantized weights, kvtier as it was: every weight dequantized
    float_eng = engine("none") if eng.model.quantized and not args.no_float else None
    path = resolve_model_path(args.model)
    hf = None if args.no_transformers else load_hf(path, DTYPES[args.dtype], device)
    llama, results = None, {"llama_flash": False, "llama_missing": "", "llama_rows": ""}
    if not path.endswith(".gguf") or args.device != "cpu":
        results["llama_missing"] = "llama.cpp: not measured (it runs GGUF files, here on CPU)."
    elif not llama_cpp.available():
        results["llama_missing"] = "llama.cpp: not measured here, ik-llama-cpp-python is not installed."
    else:
        llama = llama_cpp.LlamaCpp(path, args.threads, need + 64 * batch, batch)
        results["llama_flash"], results["llama_rows"] = llama.flash_attention, llama.rows_note
    results["file_tensor_bytes"] = sum(int(t.n_bytes) for t in GGUFFile(path).tensors) \
        if os.path.isfile(path) else 0
    print(f"kvtier: {eng.model_name}, {args.dtype}, {args.device}, {args.threads} threads", flush=True)
    results |= measure(args, eng, contestants(eng, float_eng, hf, llama, device), hf, device)
    section = render(results, args, eng, command)
    publish(section, args)
    if args.profile:
        profile_decode(eng, args, device)


def decode_products(model) -> str:
    """The int4 decode products chosen at load, per shape, with what each candidate measured; empty elsewhere."""
    return "".join(f"; {described(n, k, chosen, times)}" for (n, k), (chosen, times) in model.decode_products.items())


def profile_decode(eng: LLMEngine, args: argparse.Namespace, device: torch.device) -> None:
    """kvtier's decode steps at the smallest batch (from when every sequence has its first token: no prefill) under
    torch's profiler (CUDA kernels too, inside graphs), its ops and kernels by self time into args.profile: where a
    step's time goes beside the floor."""
    from torch.profiler import ProfilerActivity, profile
    batch = min(args.decode_batch)
    prompts = random_prompts(torch.Generator().manual_seed(1), batch, args.decode_context, eng.model_config.vocab_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    try:
        rate = kvtier_decode(eng, prompts, args.decode_tokens, "profiled", lambda: prof)
    except Exception as e:     # the tables are published already: a profiler that fails costs only its file
        print(f"the profile of decode b={batch} failed: {type(e).__name__}: {e}", flush=True)
        return
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    with open(args.profile, "w") as f:
        f.write(f"kvtier {eng.model_name}, decode b={batch}, {args.decode_tokens} tokens after "
                f"{args.decode_context}: {rate:.1f} tok/s under the profiler\n\n{table}\n")
    print(f"profile of decode b={batch} written to {args.profile}", flush=True)


if __name__ == "__main__":
    main()
