"""Attention over the paged KV pool.

The model sees the pool only through `AttentionMetadata`: where each new token's K/V
goes (`slot_mapping`) and, per sequence, which slots hold its context. Under bounded
residency a decode attends to the resident slots only, while a prefill chunk also gets the
paged-out blocks' K/V, streamed to the device one layer at a time, so prompts are computed
exactly. It can also hand back some rows' queries, which the pager scores blocks with.

On CUDA, decodes and prefill chunks after a cached prefix run through the Triton paged
kernels (triton_attention.py) on block tables built once per step; a first chunk runs
through SDPA's causal flash kernel; a bounded chunk with paged-out K/V, and every context
when Triton is missing, is gathered and masked. On CPU the context is read where it lies, but by a prompt chunk
that attends in bfloat16 (`PrefillSeq.dtype`), which copies it into one run of keys in that dtype.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


# On CPU a context is attended in segments of this many tokens (the last one shorter), cut at these positions and
# never where its blocks happen to lie: each is read where it lies when its slots are consecutive, else gathered.
# So a prompt chunk after a cached prefix, or a decode, computes the same numbers wherever the pool put its blocks
# (a segment per run of slots did not: two engines serving one conversation could answer differently).
CONTEXT_SEGMENT = 8192
# On CPU a decode attends on its own, where its K/V lies, when it is the step's only one or its context has at least
# this many tokens; shorter ones share one gathered, padded call. Per layer on a 2-core EPYC with SmolLM2's 3 K/V
# heads of 64: one sequence of 130-1000 tokens 46-180 us apart against 98-471 gathered; at 600 tokens apart wins at
# every batch (8 sequences: 1.6 ms against 7.2); at 130-300 tokens 4-8 sequences gathered are up to 1.5x faster
CPU_DECODE_APART = 512
# On CPU, query rows (heads folded into their K/V head's) up to this many attend over a transposed V as it lies, more
# over a copy (_segment_parts_cpu): at 7.6K tokens of context 3 rows took 4.8 ms a layer against 9.5, 24 as long
# as a copy and the flash kernel, 192 2.7x as long
TRANSPOSED_ROWS = 24
# On CPU a prompt chunk attending in bfloat16 (PrefillSeq.dtype) takes its context and its own K/V as one
# run of keys padded to whole blocks of this many, torch's CPU flash kernel's own block of keys (its kv_split_size):
# over a chunk and its context's segments merged, bfloat16's rounding of each part put a row ~5e-4 apart from one
# prompt's cut into chunks to another's, and a tiny model's greedy tokens changed with the scheduler's chunks
PROMPT_KEY_BLOCK = 512
PROMPT_QUERY_BLOCK = 256     # and its rows this many a call, each call over the keys its last row needs,
PROMPT_QUERY_STEP = 16       # padded to whole steps of this many (AMX tiles of rows: a lone row takes another path)


@dataclass
class PrefillSeq:
    query_start: int                  # first row of this sequence in the flat token batch
    query_len: int
    prefix_runs: list[tuple[int, int]]  # pool slot ranges [a, b) of the resident positions before this chunk
    blocks: list[int]                    # its block table up to the chunk's end (NOT_RESIDENT where paged out)
    # K/V of the blocks before this chunk that are not resident [2, layers, tokens, kv_heads, head_dim], in host
    # memory; each layer's slice visits the device only while that layer attends (bounded residency)
    paged_out: torch.Tensor | None = None
    # on CPU, the dtype it attends in (None: the queries' own): the runner's choice for its prompt (bfloat16 where the
    # model's prompt rows multiply in it: `Decoder.prompt_attention_dtype`, `ModelRunner._attention_dtype`)
    dtype: torch.dtype | None = None
    _slots: torch.Tensor | None = None

    def prefix_slots(self, device: torch.device) -> torch.Tensor:
        """The resident prefix's slots as one index, built once per step for every layer's gather."""
        if self._slots is None:
            self._slots = to_device(_slots_of(self.prefix_runs), device)
        return self._slots


def resident_blocks(runs: list[tuple[int, int]], block_size: int) -> tuple[list[int], int]:
    """A decode context's resident blocks in order, and its length, from its slot runs (a hole is never the last
    block, so the blocks' count is the length's)."""
    return [b // block_size for a, end in runs for b in range(a, end, block_size)], sum(end - a for a, end in runs)


@dataclass
class DecodeGroup:
    query_rows: list[int]                  # rows of the flat batch that decode one token each
    runs: list[list[tuple[int, int]]]      # per row, pool slot ranges [a, b) of its context, this token's included
    # (rows, block tables, context lengths) already in a captured decode graph's buffers: the kernel reads them
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    longest: int = 0     # tokens of the longest context
    # the kernel's grid of parts per context and the most parts a context gets: set by a graph at capture, else
    # from `longest` and the device
    num_splits: int | None = None
    most_parts: int | None = None
    # verify steps: (index of the first of its rows in query_rows, its rows, pool slot ranges of the context before
    # them), attended on CPU as one chunk after that context
    verify: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)

    def __post_init__(self):
        if self.tensors is None:
            self.longest = max(sum(end - a for a, end in runs) for runs in self.runs)

    def kernel_args(self, block_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(rows, block tables [B, max_blocks], context lengths) for the decode kernel."""
        if self.tensors is not None:
            return self.tensors
        tables, lens = zip(*(resident_blocks(runs, block_size) for runs in self.runs))
        return (to_device(torch.tensor(self.query_rows, dtype=torch.int32), device),
                _padded_tables(list(tables), device), to_device(torch.tensor(lens, dtype=torch.int32), device))

    def padded(self, device: torch.device, skip: set[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows but those in skip, their contexts' slots [B, max_len] padded with slot 0, and the mask
        [B, 1, 1, max_len] of real ones."""
        kept = [i for i in range(len(self.runs)) if i not in skip]
        slots = [_slots_of(self.runs[i]) for i in kept]
        lens = torch.tensor([len(x) for x in slots])
        kv_slots = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
        mask = torch.arange(kv_slots.shape[1])[None, :] < lens[:, None]
        return (to_device(torch.tensor([self.query_rows[i] for i in kept]), device), to_device(kv_slots, device),
                to_device(mask[:, None, None, :], device))


@dataclass
class AttentionMetadata:
    positions: torch.Tensor       # [T] position of every token in the flat batch
    slot_mapping: torch.Tensor    # [T] pool slot where each token's K/V is written
    prefills: list[PrefillSeq]
    decode: DecodeGroup | None
    capture_rows: torch.Tensor | None = None   # rows whose queries each layer appends to `captured`
    # rows of tokens the model generated, as opposed to prompt tokens (a cached prompt's last token also runs as a
    # one-token decode): quantized weights multiply them as decodes (quantized.py)
    generated_rows: list[int] = field(default_factory=list)
    # on CPU, rows of a prompt's last token, cached or not (but a bounded sequence's computed in its chunk): each
    # attends alone, as a decode over the pool after its chunk's K/V is written, so that it computes the same bits
    # warm and cold
    alone_rows: list[int] = field(default_factory=list)
    # on CPU, rows of a prompt's last token, alone or not: quantized weights multiply them to about float32's
    # precision (quantized.py, `decoding`)
    last_prompt_rows: list[int] = field(default_factory=list)
    captured: list[torch.Tensor] = field(default_factory=list)   # per layer [len(capture_rows), H, D]
    feature_layers: tuple[int, ...] = ()       # layers whose outputs a drafter reads (DFlash)
    features: dict[int, torch.Tensor] = field(default_factory=dict)   # such a layer → its output rows [T, hidden]
    layer: int = 0                             # the layer being computed, set by the decoder
    block_size: int = 0
    _kernel_args: dict = field(default_factory=dict)   # built by the first layer, used by every layer

    def stacked_features(self) -> torch.Tensor | None:
        """The feature layers' outputs side by side [T, features], in the drafter's order of layers; None without
        any."""
        return torch.cat([self.features[i] for i in self.feature_layers], -1) if self.feature_layers else None

    def kernel_args(self, name: str, build):
        if name not in self._kernel_args:
            self._kernel_args[name] = build()
        return self._kernel_args[name]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Step metadata built on the host, on the device. On CUDA through pinned memory and without waiting for the
    copy (the caching host allocator keeps the pinned buffer until the copy is done): a step's host
    synchronization is its sampling's alone."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _slots_of(runs: list[tuple[int, int]]) -> torch.Tensor:
    """The pool slots of slot ranges [a, b), in order, as one index."""
    return torch.cat([torch.arange(a, b) for a, b in runs] or [torch.empty(0, dtype=torch.long)])


def _padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, tables)))
    return to_device(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), device)


@functools.cache
def triton_module(name: str):
    """kvtier.models.<name>, a module of Triton kernels, or None where Triton is not installed (CUDA builds of torch
    ship it)."""
    try:
        return importlib.import_module(f"kvtier.models.{name}")
    except ImportError:
        return None


def triton_supports(head_dim: int, block_size: int) -> bool:
    """Whether Triton is installed and its kernels tile this head size and block size."""
    kernels = triton_module("triton_attention")
    return kernels is not None and kernels.supports(head_dim, block_size)


# SDPA's backends on CUDA, all but cuDNN's, which torch prefers on Hopper: cuDNN builds an execution plan for each new
# shape it sees, and on an H200 every turn whose first chunk had a length not seen before took 70-110 ms longer (all
# of the 2026-11-28 GPU check's TTFT runs: a 1,859-token prompt 67 ms cold, a 4,151-token one, whose first chunk is
# 2,048 long every time, 42 ms); FlashAttention and the memory-efficient kernels build nothing per shape
PLAN_FREE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention ([batch, heads, len, D] each), on CUDA through the backends that build nothing
    per shape."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kwargs)
    q, k, v, enable_gqa = plan_free_inputs(q, k, v, enable_gqa, kwargs)
    with plan_free():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kwargs)


def plan_free_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, kwargs: dict
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """q, k, v and enable_gqa as a plan-free backend other than math takes them: FlashAttention takes neither a mask
    nor float32, and torch 2.11's memory-efficient kernel no grouped heads, so there each K/V head is repeated for
    its group of query heads (the math backend would build the whole score matrix)."""
    if enable_gqa and (kwargs.get("attn_mask") is not None or q.dtype == torch.float32):
        group = q.shape[1] // k.shape[1]
        return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
    return q, k, v, enable_gqa


def plan_free():
    """The context sdpa runs SDPA in on CUDA: PLAN_FREE_BACKENDS only."""
    return sdpa_kernel(PLAN_FREE_BACKENDS)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H, D]."""
    if meta.capture_rows is not None:
        meta.captured.append(q.index_select(0, meta.capture_rows))
    stored_k, stored_v = k.to(k_cache.dtype), v.to(v_cache.dtype)      # the same tensors where the dtypes agree
    k_cache.index_copy_(0, meta.slot_mapping, stored_k)
    v_cache.index_copy_(0, meta.slot_mapping, stored_v)
    # a float16 pool's: the chunk attends to its K/V as the pool keeps them, as a later chunk reads them (warm = cold)
    k, v = stored_k.to(k.dtype), stored_v.to(v.dtype)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    # a graph's decode step runs the kernel on any device (on CPU in Triton's interpreter: how the tests check it)
    graphed = meta.decode is not None and meta.decode.tensors is not None
    use_kernels = (q.device.type == "cuda" or graphed) and triton_supports(q.shape[-1], meta.block_size)
    kernels = triton_module("triton_attention") if use_kernels else None
    prefills = meta.prefills
    if kernels is not None:
        prefills = _prefills_by_kernel(kernels, q, k_cache, v_cache, out, meta, scale)
    for seq in prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        qs, ks, vs = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, heads, n, D]
        paged_out = None if seq.paged_out is None else (seq.paged_out[0, meta.layer], seq.paged_out[1, meta.layer])
        cpu = q.device.type == "cpu"
        if cpu and (seq.dtype is not None or seq.prefix_runs or paged_out is not None):
            context = _context_segments(seq.prefix_runs, lambda: seq.prefix_slots(q.device), k_cache, v_cache) + \
                ([paged_out] if paged_out else [])
            o = _attention_after_segments_cpu(qs, ks, vs, context, scale) if seq.dtype is None else \
                _prompt_attention_cpu(qs, ks, vs, context, scale, seq.dtype)
        elif not seq.prefix_runs and paged_out is None:
            o = sdpa(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kp, vp = (c[seq.prefix_slots(q.device)] for c in (k_cache, v_cache))
            if paged_out is not None:     # prompt tokens attend to every earlier block, resident or not
                kp = torch.cat([kp, paged_out[0].to(kp.device, non_blocking=True)])
                vp = torch.cat([vp, paged_out[1].to(vp.device, non_blocking=True)])
            o = _attention_after_prefix(qs, ks, vs, *(x.transpose(0, 1).unsqueeze(0) for x in (kp, vp)), scale)
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        if kernels is not None:
            rows, tables, lens = meta.kernel_args("decode", lambda: d.kernel_args(meta.block_size, q.device))
            most = d.most_parts or kernels.max_parts(k_cache.shape[1], kernels.multiprocessors(q.device))
            splits = d.num_splits or kernels.parts(d.longest, most)
            kernels.decode(q, k_cache, v_cache, out, rows, tables, lens, meta.block_size, scale, splits, most)
        else:
            # on CPU a verify step's rows attend as a prompt chunk after the context before them (one read of it
            # for them all, not one per row); a lone decode, a long context or a prompt's last token is read where it
            # lies, one sequence at a time; the others are gathered and padded into one batched call, which costs
            # less than a call per sequence while they are short
            chunked = _verify_chunks_cpu(q, k, v, k_cache, v_cache, out, meta, scale) if q.device.type == "cpu" \
                else set()
            alone = meta.kernel_args("alone", lambda: set(meta.alone_rows))
            apart = [i for i, runs in enumerate(d.runs) if q.device.type == "cpu" and i not in chunked
                     and (len(d.runs) == 1 or sum(b - a for a, b in runs) >= CPU_DECODE_APART
                          or d.query_rows[i] in alone)]
            for i in apart:
                row, runs = d.query_rows[i], d.runs[i]
                qs = q[row:row + 1].transpose(0, 1).unsqueeze(0)     # [1, H, 1, D]
                slots = _slots_once(meta, ("decode", i), runs)
                parts = _segment_parts_cpu(qs, k.shape[1], _context_segments(runs, slots, k_cache, v_cache), scale)
                out[row] = _merged(parts)[0, :, 0]
            if len(apart) + len(chunked) < len(d.runs):
                skip = set(apart) | chunked
                rows, kv_slots, mask = meta.kernel_args("gathered", lambda: d.padded(q.device, skip=skip))
                qs = q[rows].unsqueeze(2)                                 # [B, H, 1, D]
                ks = k_cache[kv_slots].to(q.dtype).permute(0, 2, 1, 3)    # [B, KVH, L, D]
                vs = v_cache[kv_slots].to(q.dtype).permute(0, 2, 1, 3)
                o = sdpa(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
                out[rows] = o.squeeze(2)
    return out


def _verify_chunks_cpu(q, k, v, k_cache, v_cache, out, meta: AttentionMetadata, scale: float) -> set[int]:
    """Each verify step's rows, causally over themselves after the context before them (as a prompt chunk after a
    cached prefix). Returns the indices in the decode group's query_rows it attended."""
    chunked, d = set(), meta.decode
    for i, n, prefix in d.verify:
        rows = slice(d.query_rows[i], d.query_rows[i] + n)
        qs, ks, vs = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        segments = _context_segments(prefix, _slots_once(meta, ("verify", i), prefix), k_cache, v_cache)
        o = _attention_after_segments_cpu(qs, ks, vs, segments, scale)
        out[rows] = o.squeeze(0).transpose(0, 1)
        chunked.update(range(i, i + n))
    return chunked


def _prefills_by_kernel(kernels, q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float) -> list[PrefillSeq]:
    """Run every chunk after a cached, resident prefix through the paged prefill kernel in one launch; returns the
    chunks left to the other paths (first chunks, and chunks with paged-out K/V)."""
    taken = [seq for seq in meta.prefills if seq.prefix_runs and seq.paged_out is None]
    if taken:
        def build():
            def ints(values):
                return to_device(torch.tensor(values, dtype=torch.int32), q.device)
            context_starts = [sum(b - a for a, b in seq.prefix_runs) for seq in taken]
            return (ints([seq.query_start for seq in taken]), ints([seq.query_len for seq in taken]),
                    ints(context_starts), _padded_tables([seq.blocks for seq in taken], q.device),
                    max(seq.query_len for seq in taken))
        starts, lens, context_starts, tables, longest = meta.kernel_args("prefill", build)
        kernels.prefill(q, k_cache, v_cache, out, starts, lens, context_starts, tables, longest, meta.block_size,
                        scale)
    return [seq for seq in meta.prefills if seq not in taken]


def _context_segments(runs: list[tuple[int, int]], slots: Callable[[], torch.Tensor], k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A context's K/V (runs of pool slots, in order) in segments of CONTEXT_SEGMENT tokens: views where a segment's
    slots are one run, else gathered by `slots()`, the context's slots as one index (built once for every layer): one
    gather copies a scattered context 2-10x faster than joining its runs (8K tokens in blocks of 16, per layer: K
    0.24-0.33 ms against 2.4-3.0, a transposed V 5.3-6.9 against 11.6-13.5)."""
    segments, start, filled, pieces = [], 0, 0, 0
    for a, b in runs:
        while a < b:
            take = min(b - a, CONTEXT_SEGMENT - filled)
            if not filled:
                first = a
            filled, pieces, a = filled + take, pieces + 1, a + take
            if filled == CONTEXT_SEGMENT:
                segments.append(_segment(first, start, filled, pieces, slots, k_cache, v_cache))
                start, filled, pieces = start + filled, 0, 0
    if filled:
        segments.append(_segment(first, start, filled, pieces, slots, k_cache, v_cache))
    return segments


def _segment(first: int, start: int, length: int, pieces: int, slots: Callable[[], torch.Tensor],
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment of `length` tokens from the context's position `start`: in one run from slot `first` (a view), or
    gathered from its `pieces` runs."""
    if pieces == 1:
        return k_cache[first:first + length], v_cache[first:first + length]
    index = slots()[start:start + length]
    return k_cache.index_select(0, index), v_cache.index_select(0, index)


def _slots_once(meta: AttentionMetadata, key: tuple, runs: list[tuple[int, int]]) -> Callable[[], torch.Tensor]:
    """runs' slots as one index, built by the first layer that gathers them and kept in meta for the others."""
    return lambda: meta.kernel_args(key, lambda: _slots_of(runs))


def _attention_after_prefix(q, k, v, k_prefix, v_prefix, scale: float) -> torch.Tensor:
    """Causal attention of a chunk over [cached prefix | the chunk itself]; tensors [1, heads, len, D]."""
    n, p = q.shape[2], k_prefix.shape[2]
    mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(diagonal=p)
    return sdpa(q, torch.cat([k_prefix, k], 2), torch.cat([v_prefix, v], 2), attn_mask=mask, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1])


def _attention_after_segments_cpu(q, k, v, segments: list[tuple[torch.Tensor, torch.Tensor]],
                                  scale: float) -> torch.Tensor:
    """Causal attention of a chunk (q [1, heads, n, D], k and v [1, kv_heads, n, D]) over earlier K/V given as
    segments ([len, kv_heads, D] each, in any order) and itself. A masked call would compute every masked-out
    score, so each segment is attended without a mask and the chunk causally, and the parts are merged."""
    groups = q.shape[1] // k.shape[1]
    parts = _segment_parts_cpu(q, k.shape[1], segments, scale)
    parts.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True, scale=scale))
    return _merged(parts)


def _prompt_attention_cpu(q, k, v, segments: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of a prompt chunk (q [1, heads, n, D], k and v [1, kv_heads, n, D]) over its context
    (segments [len, kv_heads, D] each: in position order, but a bounded sequence's paged-out K/V after its resident
    ones, whose bits then follow what is resident) and itself, in `dtype` by torch's flash kernel: [1, heads, n, D]
    in dtype, bitwise the same however the prompt was cut into chunks. The context and the chunk's own K/V are one
    run of keys from the context's first, padded with masked keys to whole blocks of PROMPT_KEY_BLOCK, the kernel's
    block of keys: a row's sums over each block then take the same order whatever the chunk's length. The rows go
    PROMPT_QUERY_BLOCK at a time (each over the keys its last row needs, in whole blocks), in reverse order, so that
    the causal mask is a view of one row of values (`_staircase`), after zero rows that make them a whole number of
    PROMPT_QUERY_STEP (the kernel takes a lone row in a block of its own otherwise than among others), each query
    head over its K/V head as the kernel takes them (no copy per query head)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads, n, dim = q.shape[1:]
    kv_heads = k.shape[1]
    start = sum(len(ks) for ks, _ in segments)
    total = _whole_key_blocks(start + n)
    keys, values = (torch.empty(kv_heads, total, dim, dtype=dtype) for _ in range(2))
    keys[:, start + n:], values[:, start + n:] = 0, 0
    at = 0
    for ks, vs in segments + [(k[0].transpose(0, 1), v[0].transpose(0, 1))]:
        keys[:, at:at + len(ks)] = ks.transpose(0, 1)
        if vs.stride(-1) == 1:
            values[:, at:at + len(vs)] = vs.transpose(0, 1)
        else:       # ggml's CPU pools' transposed V: converted as it lies, then turned (1.5x faster at 30K keys)
            values[:, at:at + len(vs)] = vs.permute(1, 2, 0).to(dtype).transpose(1, 2)
        at += len(ks)
    out = torch.empty(1, heads, n, dim, dtype=dtype)
    for a in range(0, n, PROMPT_QUERY_BLOCK):
        b = min(n, a + PROMPT_QUERY_BLOCK)
        end, pad = _whole_key_blocks(start + b), -(b - a) % PROMPT_QUERY_STEP
        rows = torch.cat([q.new_zeros(1, heads, pad, dim), q[:, :, a:b].flip(2)], 2).to(dtype)
        mask = _staircase(pad + b - a, end, start + b + pad, dtype)
        o = flash(rows, keys[None, :, :end], values[None, :, :end], attn_mask=mask, scale=scale)[0]
        out[:, :, a:b] = o[:, :, pad:].flip(2)
    return out


def _whole_key_blocks(keys: int) -> int:
    return -(-keys // PROMPT_KEY_BLOCK) * PROMPT_KEY_BLOCK


def _staircase(rows: int, keys: int, last_allowed: int, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask [1, 1, rows, keys] of `rows` query rows in reverse order, row r (the r-th from the last)
    allowed its first last_allowed - r keys: 0 where allowed, -inf where not, as a view (strides 0, 0, 1, 1) of one
    row of rows + keys values."""
    line = torch.full((rows + keys,), float("-inf"), dtype=dtype)
    line[:last_allowed] = 0
    return line.as_strided((1, 1, rows, keys), (0, 0, 1, 1))


def _segment_parts_cpu(q, kv_heads: int, segments: list[tuple[torch.Tensor, torch.Tensor]],
                       scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, log-sum-exp) of q [1, heads, n, D] over each K/V segment [len, kv_heads, D], unmasked, with the
    flash kernel. The query heads sharing a K/V head are folded into its rows, so the K/V is read where it lies,
    never copied per query head. A transposed V (ggml's CPU pools: its slots contiguous) the flash kernel cannot
    read (it reads V's rows in place, and gave wrong numbers): up to TRANSPOSED_ROWS folded rows (a prompt's last
    token, a short turn) attend by two products that read it as it lies, more copy it first (2-5 ms a layer at 7.6K
    tokens, small beside their attention)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads, n, dim = q.shape[1:]
    folded = q.reshape(1, kv_heads, heads // kv_heads * n, dim)
    parts = []
    for ks, vs in segments:
        ks = ks.to(q.dtype)     # a float16 pool's K/V in the queries' dtype; V converted as it is laid out for use
        if vs.stride(-1) != 1 and folded.shape[2] <= TRANSPOSED_ROWS:
            o, lse = _attention_over_transposed(folded[0], ks, vs.to(q.dtype), scale)
        else:
            # one copy (`to` leaves a tensor of the same dtype as it lies, whatever the memory format asked)
            vs = vs.contiguous() if vs.dtype == q.dtype else vs.to(q.dtype, memory_format=torch.contiguous_format)
            o, lse = flash(folded, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), scale=scale)
        parts.append((o.reshape(1, heads, n, dim), lse.reshape(1, heads, n)))
    return parts


def _attention_over_transposed(folded: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [kv_heads, rows, D], log-sum-exp [kv_heads, rows]) of folded queries [kv_heads, rows, D] over K and
    a transposed V ([len, kv_heads, D] each): products that take both as they lie (V's slots as a transposed
    matrix's rows)."""
    scores = torch.matmul(folded, ks.permute(1, 2, 0)) * scale        # [kv_heads, rows, len]
    lse = torch.logsumexp(scores, -1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp(), vs.transpose(0, 1)), lse


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of the parts' keys, from each part's output and log-sum-exp."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), 0)
    return sum(o * (part_lse - lse).exp().unsqueeze(-1) for o, part_lse in parts)
