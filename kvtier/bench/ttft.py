"""Multi-turn TTFT: the next turn of a long conversation, cold and warm from each KV tier.

For each history length: a deterministic conversation of that many templated tokens, then a
new ~50-token user message. Time to first token (add_request → first token, max_tokens=1) of
the new turn, measured on four engines side by side:
  cold          nothing cached: the whole prompt is prefilled;
  device        the history ran before on the same engine; its blocks are in the device pool;
  host          pure-tier mode (no device prefix cache): the history's blocks come from host RAM;
  back-to-back  the host engine computes the history afresh and the new turn follows at once, as an
                agent's tool loop sends it: the history's newest blocks are still being saved;
  disk          the history ran on another engine that then shut down; a new engine restores it
                from disk, with the page cache dropped first.
Raw copy bandwidth (a memcpy on CPU, a pinned host-to-device copy on CUDA) and file-read bandwidth
are measured in the same run, to put each restore in scale.

    python -m kvtier.bench.ttft [--lengths 1024,1800,4096,8192] [--repeats 2] [--device cuda --shape llama-3.2-1b]
                                [--no-write]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import shutil
import tempfile
import time

import torch

from kvtier.bench.report import (
    add_device_args,
    add_output_args,
    device_settings,
    header,
    int_list,
    parse_command,
    processors,
    publish,
    verdict,
)
from kvtier.bench.shapes import add_model_args, resolve_model
from kvtier.bench.watch import forwards_seen
from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.warmup import warm_up
from kvtier.kv.pool import KVPool
from kvtier.models.choice import timed

SECTION = "## Multi-turn TTFT (cold vs warm tiers)"
TARGET_LENGTH = 4096          # the targets on TTFT are read at this history length
HOST_SPEEDUP_TARGET = 40      # cold / warm-host
DISK_SPEEDUP_TARGETS = {1800: 10, 4096: 20}   # history length → cold / warm-disk after a restart
BACK_TO_BACK_TARGET = 1.15    # host tier, the next turn sent as the last answer arrives / warm device
RESTORE_SHARE_TARGET = 0.5    # restore bandwidth / raw bandwidth, for both tiers
NEW_MESSAGE_TOKENS = 50
NEW_TURN_ROOM = 128           # tokens kept free under the context limit for the new turn
LONG_COLD = 8192              # cold runs at histories this long take ~30-50 s each: timed once
MODES = ("cold", "device", "host", "back-to-back", "disk")

# --- the conversation ---------------------------------------------------------------------------

OPENERS = ("", "", "", "Honestly, ", "Last Tuesday, ", "In the end, ", "As far as I know, ", "Surprisingly, ",
           "Meanwhile, ", "To be fair, ")
SUBJECTS = ("the engineer", "my neighbour", "a small team in Lisbon", "the old ferry captain", "our support desk",
            "the research group", "a curious student", "the night-shift nurse", "the city council",
            "her younger brother", "the orchestra", "a freight company", "the librarian", "two of the interns")
VERBS = ("rebuilt", "measured", "argued about", "wrote down", "carefully tested", "forgot", "painted", "shipped",
         "compared", "reviewed", "borrowed", "translated", "rescheduled", "photographed")
OBJECTS = ("the budget for next spring", "a wooden bridge", "three versions of the report",
           "a box of old letters", "a recipe for lentil soup", "the map of the northern coast", "every failing test",
           "the tide tables", "a broken bicycle", "the quarterly numbers", "a chapter about volcanoes",
           "the train timetable", "the seating plan", "a list of {n} questions")
TAILS = ("before the storm arrived", "while everyone else was asleep", "because the deadline had moved",
         "although nobody had asked", "after a long lunch", "in less than {n} minutes", "with surprising patience",
         "for the second time this week", "near the harbour", "without telling anyone", "and then went home")


def sentence(rng: random.Random) -> str:
    words = f"{rng.choice(OPENERS)}{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}"
    words = words.format(n=rng.randint(2, 99))
    return words[0].upper() + words[1:] + rng.choice((".", ".", ".", "!", "?"))


def text(rng: random.Random, tokenizer, num_tokens: int) -> str:
    """Sentences until the text is at least num_tokens tokens long (at least one sentence)."""
    sentences = [sentence(rng)]
    while len(tokenizer.encode(" ".join(sentences))) < num_tokens:
        sentences.append(sentence(rng))
    return " ".join(sentences)


def conversation(tokenizer, num_tokens: int, seed: int) -> list[dict]:
    """User and assistant turns of a few hundred tokens each, until the templated history is about num_tokens."""
    rng = random.Random(seed)
    messages: list[dict] = []
    size = 0
    while num_tokens - size > 32:
        messages.append({"role": "user",
                         "content": text(rng, tokenizer, min(rng.randint(100, 300), (num_tokens - size) // 3))})
        left = num_tokens - len(tokenizer.apply_chat_template(messages))
        messages.append({"role": "assistant", "content": text(rng, tokenizer, min(rng.randint(200, 450), left - 8))})
        size = len(tokenizer.apply_chat_template(messages))
    return messages


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_turns(tokenizer, lengths: list[int], repeats: int, max_model_len: int) -> list[dict]:
    """Per history length: the history prompt, one new-turn prompt per repeat (a different message
    each), and per repeat the prompt tokens a warm run must find cached."""
    turns = []
    for length in lengths:
        messages = conversation(tokenizer, min(length, max_model_len - NEW_TURN_ROOM), seed=length)
        history = tokenizer.apply_chat_template(messages)
        rng = random.Random(-length)
        prompts = [tokenizer.apply_chat_template(messages + [
            {"role": "user", "content": text(rng, tokenizer, NEW_MESSAGE_TOKENS)}]) for _ in range(repeats)]
        # the longest prefix shared with what the engine computed before: the history and the earlier
        # repeats' turns, whose last blocks are kept whole or partial (the last token is always computed)
        expected = [min(max(shared_prefix(seen, p) for seen in [history, *prompts[:r]]), len(p) - 1)
                    for r, p in enumerate(prompts)]
        turns.append({"length": length, "history": history, "prompts": prompts, "expected": expected})
    return turns


# --- timing -------------------------------------------------------------------------------------

def settle(eng: LLMEngine) -> None:
    """Wait for the background saves to land, then step once so the engine applies them."""
    while not eng.kv.idle():
        time.sleep(0.005)
    eng.step()


def load_seconds(eng: LLMEngine) -> float:
    """The loader's total time restoring prefixes from the tiers so far (0 without tiers)."""
    return eng.kv.load_seconds_sum


def computed_instead(eng: LLMEngine) -> int:
    """Cached tokens the engine has computed so far because its rates said that was faster than loading."""
    return sum(eng.kv.rates.computed_instead.values())


def ttft(eng: LLMEngine, request_id: str, prompt: list[int], salt: str | None = None,
         settled: bool = True) -> tuple[float, int, float, int, list[tuple[float, bool]]]:
    """Seconds from add_request to the first token, the prompt tokens that came from a cache, the seconds
    the loader spent restoring them from a tier, the cached tokens computed instead (compute-or-load), and the
    engine's steps until then (seconds, whether it ran a forward): where a turn's time went.
    salt: the request's cache salt; settled: wait for its saves to land before returning."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loaded, computed = load_seconds(eng), computed_instead(eng)
    forwards, steps, elapsed, start = [], [], None, time.perf_counter()
    with forwards_seen(eng, forwards.append):
        eng.add_request(request_id, prompt, params, cache_salt=salt)
        while eng.has_unfinished():     # its first token ends it; then the saves it started land
            began, ran = time.perf_counter(), len(forwards)
            done = [out for out in eng.step() if out.finished]
            if elapsed is None:
                steps.append((time.perf_counter() - began, len(forwards) > ran))
            if done:
                elapsed = time.perf_counter() - start
                cached = done[0].num_cached_tokens
    if settled:
        settle(eng)
    return elapsed, cached, load_seconds(eng) - loaded, computed_instead(eng) - computed, steps


def steps_note(steps: list[tuple[float, bool]]) -> str:
    """Where a turn's time went: its engine steps that computed and those that did not (waiting for a restore)."""
    computing = [s for s, forward in steps if forward]
    waiting = [s for s, forward in steps if not forward]
    return (f"; {len(computing)} steps computing {sum(computing) * 1e3:.1f} ms, {len(waiting)} not "
            f"{sum(waiting) * 1e3:.1f} ms")


def drop_page_cache(directory: str) -> str:
    """Evict the directory's files from the page cache; returns how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "echo 1 > /proc/sys/vm/drop_caches"
    except OSError:
        for root, _, files in os.walk(directory):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "os.posix_fadvise(POSIX_FADV_DONTNEED) on every file of the disk tier"


def copy_bandwidth(nbytes: int, device: torch.device) -> tuple[float, str]:
    """GB/s of copying a host tensor into a preallocated one on the device, best of 3, and what was measured:
    a memcpy on CPU, a copy from pinned memory on CUDA (what a restore from the host tier does)."""
    cuda = device.type == "cuda"
    src = torch.ones(nbytes // 4, pin_memory=cuda)
    dst = torch.empty(nbytes // 4, device=device)
    seconds = timed([lambda: dst.copy_(src, non_blocking=cuda)], device, repeats=3)
    return nbytes / seconds / 1e9, "pinned host-to-device copy" if cuda else "memcpy"


def write_probe(directory: str, nbytes: int) -> tuple[str, torch.Tensor]:
    """A file of random bytes beside the disk tier's files, and a preallocated buffer to read it into."""
    path = os.path.join(directory, "read-probe.bin")
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(memoryview(buf.numpy()))
        os.fsync(f.fileno())
    return path, buf


def file_read_bandwidth(path: str, buf: torch.Tensor) -> float:
    """GB/s of one readinto of the probe file, its page cache dropped first, into the preallocated buffer."""
    drop_page_cache(os.path.dirname(path))
    with open(path, "rb", buffering=0) as f:
        start = time.perf_counter()
        got = f.readinto(memoryview(buf.numpy()))
        seconds = time.perf_counter() - start
    if got != buf.numel():
        raise RuntimeError(f"read {got} of {buf.numel()} bytes from {path} in one call")
    return got / seconds / 1e9


def restore_by_layout(directory: str, block_shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int,
                      run_blocks: int) -> dict[str, float]:
    """Seconds to restore num_blocks from disk (page cache dropped, best of 2) when they were written
    as runs of run_blocks per file, as write-through does, and one file per block, as write-back on
    host eviction would (the host tier evicts one block at a time)."""
    from kvtier.kv.keys import chain_keys
    from kvtier.kv.tiers.disk import DiskTier
    from kvtier.kv.tiers.staging import Staging
    keys = chain_keys(list(range(num_blocks * block_shape[2])), block_shape[2], b"layout-probe-ns!")
    payload = torch.randn(block_shape).to(dtype)
    best = {}
    for layout, size in (("write-through", run_blocks), ("write-back", 1)):
        path = os.path.join(directory, f"layout-{layout}")
        tier = DiskTier(path, 1 << 40, b"layout-probe-ns!", block_shape, dtype)
        for i in range(0, num_blocks, size):
            tier.put_run(keys[i:i + size], [payload] * len(keys[i:i + size]))
        staging, times = Staging(torch.zeros(num_blocks * tier.block_bytes, dtype=torch.uint8)), []
        for _ in range(2):
            drop_page_cache(path)
            start = time.perf_counter()
            if tier.get_run(keys, staging) is None:
                raise RuntimeError(f"layout probe: {layout} files were not read back")
            times.append(time.perf_counter() - start)
        best[layout] = min(times)
        shutil.rmtree(path)
    return best


# --- the run ------------------------------------------------------------------------------------

def engine(args: argparse.Namespace, pool_tokens: int, **settings) -> LLMEngine:
    eng = LLMEngine(Config(model=args.model, num_threads=args.threads, kv_pool_tokens=pool_tokens,
                           max_batched_tokens=2048, **device_settings(args), **settings))
    warm_up(eng)      # as a server does before it is ready: no timed request pays the process's one-time costs
    return eng


def run_histories(eng: LLMEngine, turns: list[dict], tag: str) -> None:
    for turn in turns:
        ttft(eng, f"{tag}-history-{turn['length']}", turn["history"])


def measure(args: argparse.Namespace) -> dict:
    """Best TTFT and the cached tokens of every run, per history length and mode; raw bandwidths."""
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="kvtier-ttft-")
    os.makedirs(disk_dir, exist_ok=True)
    probe = write_probe(disk_dir, args.probe_mib * 2**20)
    copy_gbs, copy_label = copy_bandwidth(probe[1].numel(), torch.device(args.device))
    results = {"copy_gbs": copy_gbs, "copy_label": copy_label,
               "file_read_gbs": max(file_read_bandwidth(*probe) for _ in range(3)),
               "drop": drop_page_cache(disk_dir), "disk_dir": disk_dir}
    print(f"raw bandwidth: {copy_label} {copy_gbs:.2f} GB/s, file read {results['file_read_gbs']:.2f} GB/s "
          f"(page cache dropped with: {results['drop']})", flush=True)

    # twice what the runs need, so no cached block is ever evicted and no run waits for space
    single = 2 * (max(args.lengths) + NEW_TURN_ROOM)
    cold = engine(args, single, prefix_cache=False, kv_host_gib=0, kv_disk=False)
    mc = cold.model_config
    turns = build_turns(cold.tokenizer, args.lengths, args.repeats, cold.max_model_len)
    results.update(model=cold.model_name, dtype=cold.config.dtypes, threads=args.threads, turns=turns,
                   bytes_per_token=KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, cold.pool.dtype))
    every = 2 * sum(length + NEW_TURN_ROOM for length in args.lengths)   # the device engine keeps all histories
    device = engine(args, every, prefix_cache=True, kv_host_gib=0, kv_disk=False)
    host = engine(args, single, prefix_cache=False, kv_host_gib=4.0, kv_disk=False)
    disk_settings = {"prefix_cache": False, "kv_host_gib": 0, "kv_disk": True, "kv_disk_dir": disk_dir,
                     "kv_disk_gib": 20.0}
    writer = engine(args, single, **disk_settings)
    print("running the histories once on the device, host and disk engines", flush=True)
    run_histories(device, turns, "device")
    run_histories(host, turns, "host")
    run_histories(writer, turns, "disk")
    writer.shutdown()       # the restart: the engine that computed the histories is gone
    del writer
    gc.collect()
    disk = engine(args, single, **disk_settings)
    engines = {"cold": cold, "device": device, "host": host, "back-to-back": host, "disk": disk}

    # per length and mode: (TTFT, cached tokens, loader seconds, cached tokens computed instead) per repeat;
    # and the raw file read right after each disk restore, so the disk tier is compared with what the disk
    # gave at that moment
    runs = {t["length"]: {mode: [] for mode in (*MODES, "file_read")} for t in turns}
    for turn in turns:
        for rep, prompt in enumerate(turn["prompts"]):
            for mode in MODES:
                if mode == "cold" and rep > 0 and turn["length"] >= LONG_COLD:
                    continue
                if mode == "back-to-back" and turn["length"] >= LONG_COLD:
                    continue
                if mode == "disk":
                    drop_page_cache(disk_dir)
                seconds, cached, load, computed, steps = timed_turn(engines, mode, f"{turn['length']}-{rep}", turn,
                                                                    prompt)
                runs[turn["length"]][mode].append((seconds, cached, load, computed))
                print(f"  history {len(turn['history'])}, repeat {rep + 1}: {mode:6s} {seconds * 1e3:9.1f} ms, "
                      f"{cached} of {len(prompt)} prompt tokens cached"
                      + (f" ({computed} more computed instead)" if computed else "")
                      + (f", restored in {load * 1e3:.1f} ms" if load else "") + steps_note(steps), flush=True)
                if mode == "disk":
                    runs[turn["length"]]["file_read"].append(file_read_bandwidth(*probe))
                    read = runs[turn["length"]]["file_read"][-1]
                    print(f"    raw file read right after: {read:.2f} GB/s", flush=True)
    # the rates compute-or-load weighed, as each tier's engine measured them while serving
    results["rates"] = {mode: engines[mode].stats()["rates"] for mode in ("host", "disk")}
    for eng in engines.values():
        eng.shutdown()
    os.remove(probe[0])
    num_blocks = max(turn["expected"][0] for turn in turns) // cold.config.block_size
    results["layout"] = {"blocks": num_blocks, "run_blocks": cold.config.max_batched_tokens // cold.config.block_size,
                         **restore_by_layout(disk_dir, cold.pool.block_shape, cold.pool.dtype, num_blocks,
                                             cold.config.max_batched_tokens // cold.config.block_size)}
    print(f"restore of {num_blocks} blocks by file layout: {results['layout']}", flush=True)
    if args.disk_dir is None:
        shutil.rmtree(disk_dir)
    results["runs"] = runs
    return results


def timed_turn(engines: dict, mode: str, tag: str, turn: dict, prompt: list[int]
               ) -> tuple[float, int, float, int, list[tuple[float, bool]]]:
    """ttft of the new turn in a mode. back-to-back: the host engine computes the history afresh (its own cache
    salt) and the new turn follows as soon as the history's answer is out, its blocks' saves still in flight."""
    if mode != "back-to-back":
        return ttft(engines[mode], f"{mode}-{tag}", prompt)
    ttft(engines[mode], f"{mode}-history-{tag}", turn["history"], salt=tag, settled=False)
    return ttft(engines[mode], f"{mode}-{tag}", prompt, salt=tag)


# --- the report ---------------------------------------------------------------------------------

def summarize(results: dict) -> dict:
    """Per length: best TTFT per mode, whether every run found exactly the cached tokens it should (loaded, or
    computed where the engine's rates said that was faster),
    speedups over cold (None after a miss) and each tier's best restore time and bandwidth."""
    rows = {}
    for turn in results["turns"]:
        runs = results["runs"][turn["length"]]
        alone = [min(shared_prefix(turn["history"], p), len(p) - 1) for p in turn["prompts"]]  # no earlier repeat
        want = {"cold": [0] * len(runs["cold"]), "device": turn["expected"], "host": turn["expected"],
                "back-to-back": alone[:len(runs["back-to-back"])], "disk": turn["expected"]}
        modes = [mode for mode in MODES if runs[mode]]
        hit = {mode: [c + computed for _, c, _, computed in runs[mode]] == want[mode] for mode in modes}
        row = {"best": {mode: min(s for s, *_ in runs[mode]) for mode in modes}, "hit": hit,
               "cached": {mode: [c for _, c, *_ in runs[mode]] for mode in modes},
               "expected": turn["expected"], "history": len(turn["history"]),
               "prompts": [len(p) for p in turn["prompts"]], "file_read_gbs": max(runs["file_read"])}
        b2b = hit.get("back-to-back") and hit["device"]
        row["back-to-back/device"] = row["best"]["back-to-back"] / row["best"]["device"] if b2b else None
        for tier in ("host", "disk"):
            ok = hit["cold"] and hit[tier]
            row[f"cold/{tier}"] = row["best"]["cold"] / row["best"][tier] if ok else None
            loads = [(c * results["bytes_per_token"] / load / 1e9, load) for _, c, load, _ in runs[tier] if load]
            row[f"{tier}_gbs"], row[f"{tier}_load"] = max(loads) if ok and loads else (None, None)
        rows[turn["length"]] = row
    return rows


def seconds(row: dict, mode: str) -> str:
    if mode not in row["best"]:
        return "—"
    t = f"{row['best'][mode]:.3f} s"
    return t if row["hit"][mode] else f"{t} (**miss**: {', '.join(map(str, row['cached'][mode]))} cached)"


def ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}×"


def bandwidth(gbs: float | None, raw: float, seconds: float) -> str:
    return "—" if gbs is None else f"{gbs:.2f} ({gbs / raw:.0%}; {seconds * 1e3:.1f} ms)"


def targets(rows: dict, results: dict) -> list[str]:
    lines = []
    row = rows.get(TARGET_LENGTH)
    if row is None:
        lines.append(f"- host tier: not evaluated: read at a {TARGET_LENGTH}-token history, not in --lengths")
    else:
        host = row["cold/host"]
        lines.append(f"- warm host-tier TTFT ≤ 1/{HOST_SPEEDUP_TARGET} of cold {at(row, TARGET_LENGTH)}: "
                     f"{verdict(host is not None and host >= HOST_SPEEDUP_TARGET)} (1/{ratio(host).rstrip('×')}"
                     f"{device_floor(row)})")
    for length, target in DISK_SPEEDUP_TARGETS.items():
        if (row := rows.get(length)) is None:
            lines.append(f"- disk after a restart at {length}: not evaluated (not in --lengths)")
            continue
        disk = row["cold/disk"]
        lines.append(f"- disk-after-restart TTFT (the restarted engine warmed up as a server does) ≤ 1/{target} of "
                     f"cold {at(row, length)}: {verdict(disk is not None and disk >= target)} "
                     f"(1/{ratio(disk).rstrip('×')}{device_floor(row)})")
    b2b = {length: row["back-to-back/device"] for length, row in rows.items() if "back-to-back" in row["best"]}
    if b2b:
        worst = max(b2b.values(), key=lambda x: math.inf if x is None else x)
        lines.append(f"- host tier, the next turn sent as the last answer arrives: only the new message computed and "
                     f"TTFT ≤ {BACK_TO_BACK_TARGET}× warm device, at every length measured "
                     f"({', '.join(map(str, b2b))}): {verdict(worst is not None and worst <= BACK_TO_BACK_TARGET)} "
                     f"(at most {ratio(worst)})")
    largest = rows[max(rows)]
    shares = {"host": (largest["host_gbs"], results["copy_gbs"], results["copy_label"]),
              "disk": (largest["disk_gbs"], largest["file_read_gbs"], "file read")}
    for tier, (gbs, raw, name) in shares.items():
        share = "—" if gbs is None else f"{gbs / raw:.0%}"
        lines.append(f"- {tier} restore bandwidth ≥ {RESTORE_SHARE_TARGET:.0%} of raw {name} at the largest "
                     f"history ({largest['history']} tokens): "
                     f"{verdict(gbs is not None and gbs >= RESTORE_SHARE_TARGET * raw)} ({share})")
    return lines


def at(row: dict, length: int) -> str:
    return f"at {length} ({row['history']}-token history)"


def device_floor(row: dict) -> str:
    """The warm device run restores nothing and computes the same suffix: no tier can beat its ratio."""
    if not (row["hit"]["cold"] and row["hit"]["device"]):
        return ""
    return f"; the warm device run, which restores nothing, 1/{row['best']['cold'] / row['best']['device']:.1f}"


def rates_line(rates: dict, bytes_per_token: int) -> str:
    """What compute-or-load saw: each tier's restore bandwidth against the prefill rate, in bytes of KV."""
    parts = []
    for mode, r in rates.items():
        gbs, tps = r["tier_bytes_per_s"].get(mode), r["prefill_tokens_per_s"]
        if gbs is None or tps is None:
            parts.append(f"{mode}: not measured")
            continue
        compute_gbs = tps * bytes_per_token / 1e9
        parts.append(f"{mode} tier {gbs / 1e9:.2f} GB/s against prefill {tps:.0f} tokens/s ({compute_gbs:.3f} GB/s "
                     f"of KV): loading at {gbs / 1e9 / compute_gbs:.1f}× the speed of computing, "
                     f"{sum(r['computed_instead'].values())} cached tokens computed instead")
    return ("Compute-or-load, the rates each warm engine measured while serving (moving averages): "
            + "; ".join(parts) + ".")


def layout_line(layout: dict) -> str:
    through, back = layout["write-through"], layout["write-back"]
    return (f"Write-through vs write-back, by the files each leaves: restoring {layout['blocks']} blocks (page cache "
            f"dropped, best of 2) takes {through * 1e3:.0f} ms from runs of {layout['run_blocks']} blocks per file "
            f"(write-through saves each prefill chunk's sealed blocks together) and {back * 1e3:.0f} ms from one "
            f"file per block (write-back on host eviction, which evicts a block at a time): {back / through:.2f}× "
            f"the time.")


def filesystem(path: str) -> str:
    """'type on device' of the mount holding path."""
    path, best = os.path.realpath(path), ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, fstype = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, fstype, device)
    return f"{best[1]} on {best[2]}"


def render(results: dict, args: argparse.Namespace, command: str) -> str:
    rows = summarize(results)
    mem, label = results["copy_gbs"], results["copy_label"]
    reads = [row["file_read_gbs"] for row in rows.values()]
    table = [("| history tokens | cold TTFT | warm device | warm host | warm host, back to back | warm disk (restart) "
              f"| cold/host | back to back/device | cold/disk | host restore GB/s (% of {label}; time) "
              "| disk restore GB/s (% of file read; time) | cached / prompt tokens |"),
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows.values():
        table.append(f"| {row['history']} | {seconds(row, 'cold')} | {seconds(row, 'device')} | "
                     f"{seconds(row, 'host')} | {seconds(row, 'back-to-back')} | {seconds(row, 'disk')} | "
                     f"{ratio(row['cold/host'])} | {ratio(row['back-to-back/device'])} | "
                     f"{ratio(row['cold/disk'])} | {bandwidth(row['host_gbs'], mem, row['host_load'])} | "
                     f"{bandwidth(row['disk_gbs'], row['file_read_gbs'], row['disk_load'])} | "
                     f"{', '.join(map(str, row['expected']))} / {', '.join(map(str, row['prompts']))} |")
    machine = (f"{processors(args.device)}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"{results['threads']} threads, model {results['model']} ({results['dtype']}, "
               f"{results['bytes_per_token']} bytes of KV per token), disk tier on {filesystem(results['disk_dir'])}")
    return "\n".join([
        *header(SECTION, machine, command),
        *table,
        "",
        (f"Raw bandwidth in the same run: {label} {mem:.2f} GB/s (a {args.probe_mib} MiB tensor copied into a "
         f"preallocated one, best of 3). File read: a {args.probe_mib} MiB file in the disk tier's directory, page "
         f"cache dropped, one readinto into a preallocated buffer: {results['file_read_gbs']:.2f} GB/s at the start "
         f"(best of 3); {min(reads):.2f}-{max(reads):.2f} GB/s per row, each row's best read right after its disk "
         f"restores, which is what that row's disk restore is compared with."),
        "",
        rates_line(results["rates"], results["bytes_per_token"]),
        "",
        layout_line(results["layout"]),
        "",
        "Targets:",
        "",
        *targets(rows, results),
        "",
        (f"How: a deterministic conversation of user and assistant turns (a few hundred tokens each, chat "
         f"template applied) up to about the history length, then a new user message of about "
         f"{NEW_MESSAGE_TOKENS} tokens, a different one per repeat; TTFT is add_request to the first token "
         f"(max_tokens=1), best of {args.repeats}, the modes run one after another per repeat (cold once, and "
         f"back to back not at all, from {LONG_COLD} tokens on). cold: an engine without prefix cache or tiers. warm device: prefix cache on, "
         f"tiers off, the history ran before on the same engine. warm host: pure-tier mode (prefix cache off, host "
         f"tier 4 GiB, no disk), the history ran before and its saves landed, so every cached block comes from "
         f"host RAM. warm host, back to back: the same engine computes the history afresh (under a cache salt of "
         f"its own) and the new turn is added as soon as the history's answer is out, while its newest blocks are "
         f"still being saved; compared with warm device. warm disk (restart): prefix cache and host tier off; one engine ran the histories, waited for "
         f"its saves and shut down; a new engine (its construction not timed) serves the new turns, the page cache "
         f"dropped before each with `{results['drop']}`. Every engine first warms up as a server does before it says it "
         f"is ready (`kvtier/engine/warmup.py`), so the restarted engine's first request is timed as served. Cached tokens, per repeat: the prefix the new turn "
         f"shares with the history (or with an earlier repeat's turn), all but its last token (whole blocks, then "
         f"a copy of the partly shared block); every warm run is checked to have found exactly "
         f"that many (a run that did not is marked **miss** and gets no ratio); a tier run may compute part of "
         f"them instead, where the rates the engine measured say that is faster (counted below). Restore "
         f"bandwidth = cached tokens × bytes per token / the loader's own time for the restore (best of the "
         f"repeats): the tier read (for disk: file read into a reused, already faulted-in buffer and checksums) "
         f"plus the copy into the reserved device blocks; it leaves out the hand-offs between the engine loop and the loader, which "
         f"show in warm tier TTFT − warm device TTFT (the same suffix computed, no restore)."),
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=[1024, 1800, 4096, 8192],
                   help="history lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement; the best is reported")
    add_model_args(p)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    p.add_argument("--disk-dir", default=None, help="disk tier directory (default: a new temporary directory)")
    p.add_argument("--probe-mib", type=int, default=256, help="size of the raw bandwidth probes")
    add_device_args(p)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.ttft", argv, parse_args)
    torch.set_num_threads(args.threads)
    resolve_model(args)
    section = render(measure(args), args, command)
    publish(section, args)


if __name__ == "__main__":
    main()
