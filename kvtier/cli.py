"""Command line: kvtier serve | generate | bench | cache.

Heavy imports (torch, the engine, uvicorn) happen inside the handlers so that `kvtier --help` is fast.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

log = logging.getLogger("kvtier")

# kvtier bench NAME → kvtier.bench.NAME.main(argv)
BENCHMARKS = ("throughput", "turns", "ttft", "niah", "itl", "stall", "kernels", "spec", "agents", "gpu_check")
KEEP_ALIVE_SECONDS = 75     # how long an idle HTTP connection stays open (uvicorn: 5 s)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="LLM inference server with a tiered KV cache")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # options left out (None) keep Config's defaults
    engine = argparse.ArgumentParser(add_help=False)
    group = engine.add_argument_group("model and engine")
    group.add_argument("--model", help="local Hugging Face directory or .gguf file "
                                       "(default: the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--device", help="cpu or cuda[:N] (default: cpu)")
    group.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    group.add_argument("--quantize", choices=("auto", "none", "int8", "int4"),   # config.QUANTIZE_MODES, torch-free
                       help="weights: auto keeps a GGUF's quantized blocks as stored, multiplied through ggml on CPU "
                            "(float32) and kvtier's Triton kernels on CUDA, and on CPU a GGUF's and a checkpoint's "
                            "16-bit matrices too; none dequantizes every weight to --dtype; int8/int4 quantize a "
                            "checkpoint's projections at load (Q8_0/Q4_0, groups of 32; CPU) (default: auto)")
    group.add_argument("--kv-cache-dtype", choices=("auto", "float32", "float16"),   # config.KV_CACHE_DTYPES
                       help="the KV cache's dtype: auto keeps --dtype's; float16 (CPU) halves the cache's memory, its "
                            "tiers' bytes and a long context's decode reads, as llama.cpp's default cache does "
                            "(default: auto)")
    group.add_argument("--block-size", type=int, metavar="N",
                       help="tokens per KV block (default: 64, or 16 with --kv-resident-tokens)")
    group.add_argument("--kv-pool-tokens", type=int, metavar="N", help="tokens of KV the device pool holds "
                                                         "(default: 10%% of available RAM on CPU, 80%% of free GPU memory on CUDA)")
    group.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                       help="on CUDA, the fraction of the device's memory this server's weights and KV pool may "
                            "take (vLLM's option; activations and CUDA graphs come on top), so that several servers "
                            "share one GPU; $KVTIER_GPU_MEMORY_UTILIZATION sets it too (default: none, the pool takes "
                            "80%% of the memory free after the weights)")
    group.add_argument("--max-batched-tokens", type=int, metavar="N", help="tokens per engine step (default: 2048)")
    group.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences running at once (default: 64)")
    group.add_argument("--max-itl-ratio", type=float, metavar="R",
                       help="while prompts prefill beside running streams, a step takes at most R times a "
                            "decode-only step: the streams' inter-token latency stays within R× (default: 2; 0: "
                            "no bound, prompt chunks of --max-batched-tokens)")
    group.add_argument("--max-model-len", type=int, metavar="N", help="context limit in tokens (default: the model's)")
    group.add_argument("--threads", dest="num_threads", type=int, metavar="N", help="torch CPU threads")
    group.add_argument("--enforce-eager", action="store_true", default=None,
                       help="run decode steps eagerly, op by op, instead of replaying captured CUDA graphs (or, on CPU "
                            "with quantized weights, running each step as one ggml graph)")
    group.add_argument("--speculative", choices=("ngram", "draft", "dflash"),      # config.SPECULATIVE_METHODS, torch-free
                       help="speculative decoding: ngram proposes the tokens that followed the last earlier occurrence "
                            "of a sequence's ending in its own context (prompt lookup); draft has --draft-model "
                            "decode them; dflash has the DFlash drafter --draft-model propose a block of them from the "
                            "model's hidden features; the model verifies them in one step, so output is what it would "
                            "be without (default: off)")
    group.add_argument("--draft-model", metavar="PATH",
                       help="with --speculative draft: a smaller model with the same tokenizer (a Hugging Face "
                            "directory or a .gguf file); with dflash: a DFlash drafter directory for this model; its "
                            "KV is cached and tiered as the model's is")
    group.add_argument("--speculative-config", metavar="JSON",
                       help="vLLM's form of the options above: {\"method\": \"ngram\" | \"draft_model\" | \"dflash\", "
                            "\"model\": PATH, \"num_speculative_tokens\": K, \"prompt_lookup_min\": N, "
                            "\"prompt_lookup_max\": N} (the shortest and longest ending ngram looks up; default 2 "
                            "and 12)")
    group.add_argument("--num-speculative-tokens", type=int, metavar="K",
                       help="the most tokens a sequence proposes per step; each sequence adapts its own to how "
                            "many it gets accepted (default: 16)")
    group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                       help="do not reuse device blocks of earlier requests' prefixes")
    group.add_argument("--kv-host-gib", type=float, metavar="GIB",
                       help="host RAM tier budget, 0 to disable (default: $KVTIER_KV_HOST_GIB, else 4)")
    group.add_argument("--kv-disk-dir", metavar="DIR", help="disk tier directory (default: ~/.cache/kvtier/kv)")
    group.add_argument("--kv-disk-gib", type=float, metavar="GIB", help="disk tier budget (default: 20)")
    group.add_argument("--no-kv-disk", dest="kv_disk", action="store_false", default=None,
                       help="disable the disk tier")
    group = engine.add_argument_group("bounded residency (long context in little device memory)")
    group.add_argument("--kv-resident-tokens", type=int, metavar="N",
                       help="tokens of one sequence's KV kept on the device; the rest is paged to the host tier "
                            "(default: unlimited, exact attention)")
    group.add_argument("--kv-sink-blocks", type=int, metavar="N", help="first blocks always resident (default: 1)")
    group.add_argument("--kv-tail-blocks", type=int, metavar="N", help="last blocks always resident (default: 4)")
    group.add_argument("--kv-policy", choices=("lru", "quest", "meankey"),
                       help="how the other resident blocks are chosen (default: meankey)")
    group.add_argument("--kv-reselect-every", type=int, metavar="N",
                       help="decode tokens between reselections (default: 16)")

    serve = commands.add_parser("serve", parents=[engine], help="run the OpenAI-compatible HTTP server")
    group = serve.add_argument_group("server")
    group.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, metavar="N", help="port to bind (default: 8000)")
    group.add_argument("--served-model-name", dest="served_model_names", nargs="+", metavar="NAME",
                       help="model names clients may send; /v1/models lists them (default: the model's name)")
    group.add_argument("--any-model-name", action="store_true", default=None,
                       help="answer to any model name a client sends (as llama.cpp does; agents that call a second, "
                            "smaller model by name need it)")
    group.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health; "
                            "may repeat; $KVTIER_API_KEY also sets one, and keeps it out of the process list")
    group.add_argument("--api-key-file", metavar="FILE", help="read API keys from FILE, one per line")
    group.add_argument("--cache-salt-from-api-key", action="store_true", default=None,
                       help="requests share cached KV only with requests made with the same API key")
    group.add_argument("--max-request-bytes", type=int, metavar="N",
                       help="larger request bodies get a 413 (default: 16 MiB)")
    group.add_argument("--sse-keepalive", type=float, metavar="SECONDS",
                       help="a stream silent this long (a long prompt's prefill) answers and sends a comment, again "
                            "each time (default: 15)")
    group.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the model's")
    group.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"),
                       help="how tool calls are read from the output (default: from the chat template)")
    group.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1", "none"),
                       help="how <think> reasoning is read from the output: qwen3 (the model opens the block), "
                            "deepseek_r1 (the prompt opens it), none (default: from the chat template)")
    serve.set_defaults(handler=_serve)

    generate = commands.add_parser("generate", parents=[engine], help="answer one prompt on stdout")
    generate.add_argument("prompt", help="the user message (the chat template is applied)")
    generate.add_argument("--max-tokens", type=int, metavar="N", default=256, help="(default: %(default)s)")
    generate.add_argument("--temperature", type=float, metavar="T", default=0.7,
                          help="0 is greedy (default: %(default)s)")
    generate.add_argument("--seed", type=int, metavar="N", default=None, help="same seed, same answer")
    generate.set_defaults(handler=_generate)

    bench = commands.add_parser("bench", help="run a benchmark: kvtier bench NAME --help for its options")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("argv", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(handler=_bench)

    cache = commands.add_parser("cache", help="show what the disk tier holds, or clear it")
    cache.add_argument("action", nargs="?", choices=("info", "clear"), default="info",
                       help="info (default): size, files and namespaces; clear: delete the cached KV")
    cache.add_argument("--kv-disk-dir", metavar="DIR", help="disk tier directory (default: ~/.cache/kvtier/kv)")
    cache.set_defaults(handler=_cache)
    return parser


def _config(args):
    """Config from the options given; a bad value ends the program with its message and status 2."""
    from kvtier.config import Config, ConfigError

    given = vars(args)
    if os.environ.get("KVTIER_API_KEY") and "api_keys" in given:
        given["api_keys"] = [*(given["api_keys"] or []), os.environ["KVTIER_API_KEY"]]
    try:
        if given.get("speculative_config") is not None:
            given = given | _speculative_config(given)
        return Config(**{f.name: given[f.name] for f in dataclasses.fields(Config) if given.get(f.name) is not None})
    except ConfigError as e:
        _fail(str(e))


def _speculative_config(given: dict) -> dict:
    """--speculative-config's fields, where no option of their own says otherwise."""
    from kvtier.config import ConfigError, speculative_config

    fields = speculative_config(given["speculative_config"])
    clashing = [name for name, value in fields.items() if given.get(name) not in (None, value)]
    if clashing:
        raise ConfigError(f"--speculative-config and --{clashing[0].replace('_', '-')} say different things")
    return fields


def _fail(message: str):
    print(f"kvtier: error: {message}", file=sys.stderr)
    sys.exit(2)


def _serve(args) -> int:
    config = _config(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from kvtier.engine.async_engine import AsyncEngine
    from kvtier.server.app import build_app

    engine = AsyncEngine(config)
    terminated: list[int] = []
    try:
        app = build_app(engine, config)
        # on Ctrl-C or SIGTERM, give open streams a few seconds, then cancel them (which aborts their requests). Idle
        # connections stay open longer than clients keep them (httpx, so the OpenAI and Anthropic SDKs: 5 s; node: 4 s),
        # so a client never sends a request on a connection the server is closing at that moment
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, timeout_graceful_shutdown=5,
                                               timeout_keep_alive=KEEP_ALIVE_SECONDS))
        name = ", ".join(config.served_model_names or [engine.model_name])
        # SIGTERM (docker stop, systemd, kill) is noted and stops the server; uvicorn, which takes it while serving,
        # raises it again once it stops, where its default action would end the process before the engine's saves in
        # flight land: it ends the process only after they have (below)
        signal.signal(signal.SIGTERM, lambda signum, frame: (terminated.append(signum),
                                                             setattr(server, "should_exit", True)))
        asyncio.run(_serve_until_stopped(server, f"http://{config.host}:{config.port}/v1", name))
    finally:
        if terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)     # a second one ends the process at once
        engine.shutdown()
        log.info("kvtier stopped: the engine's queued saves have landed")
    if terminated:        # then die of it, as uvicorn meant to
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 0


async def _serve_until_stopped(server, url: str, name: str) -> None:
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        log.info("kvtier is ready: serving %r at %s", name, url)
    await serving


def _generate(args) -> int:
    config = _config(args)
    from kvtier.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        _fail(str(e))
    from kvtier.engine.async_engine import AsyncEngine

    engine = AsyncEngine(config, warm=False)      # one answer: nothing to warm up for
    try:
        return asyncio.run(_print_answer(engine, args.prompt, params))
    finally:
        engine.shutdown()


async def _print_answer(engine, prompt: str, params) -> int:
    from kvtier.engine.outputs import RequestRejected

    try:
        prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    except ValueError:   # a base model without a chat template: the plain text
        prompt_ids = engine.tokenizer.encode(prompt)
    try:
        async for out in engine.generate("generate", prompt_ids, params):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    except RequestRejected as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


def _bench(args) -> int:
    import importlib

    module = importlib.import_module(f"kvtier.bench.{args.name}")
    return module.main(args.argv) or 0


def _cache(args) -> int:
    from kvtier.config import default_disk_dir
    from kvtier.kv.tiers import inventory

    directory = os.path.expanduser(args.kv_disk_dir or default_disk_dir())
    if not os.path.isdir(directory):
        print(f"{directory}: no disk tier here (nothing cached yet)")
        return 0
    if args.action == "clear":
        removed = inventory.clear(directory)
        print(f"{directory}: deleted {removed['files']} files ({_size(removed['bytes'])})")
        return 0
    report = inventory.survey(directory)
    print(f"{directory}: {_size(report['bytes'])}")
    for ns in report["namespaces"]:
        shape = "x".join(map(str, ns["block_shape"]))
        print(f"  namespace {ns['namespace'][:16]} ({ns['dtype']}, blocks of {shape}): {ns['blocks']} blocks "
              f"in {ns['files']} files, {_size(ns['bytes'])}")
    for name in inventory.SIDE_STORES:
        print(f"  {name}: {report[name]['files']} files, {_size(report[name]['bytes'])}")
    if report["damaged"] or report["temp_files"]:
        print(f"  also: {report['damaged']} unreadable block files, {report['temp_files']} temp files "
              "(a server deletes them at start-up)")
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
