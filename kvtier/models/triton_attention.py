"""Paged attention kernels in Triton, for CUDA: they read K/V where the block tables say it lies.

No gather, no padded mask and no per-shape planning: each kernel is compiled once per
head size, block size and GQA group, and a new context length is just a new number in
`context_lens`. Both read the pool layout `[slots, kv_heads, head_dim]` of one layer.

- `decode`: one query token per sequence. A program serves one (sequence, K/V head) pair
  and all the query heads that share that K/V head at once, walking the sequence's blocks
  with an online softmax, so each K/V block is read once per step.
  A long context at a small batch would leave most of the GPU idle, so `decode` splits
  each context into parts (flash-decoding): a program per (sequence, K/V head, part) keeps
  its part's output and log-sum-exp, and a second kernel merges them. How many parts a
  context gets depends on its own length alone (`parts`), never on the batch beside it, so
  a row sums alike in any step: a verify step's rows as their decode steps would.
- `prefill`: a chunk of query tokens per sequence, attending causally to everything before
  and including each token: the cached prefix and the chunk itself, whose K/V the caller
  has already written into the pool. A program serves BLOCK_M query tokens of one head.

Tested on CPU through Triton's interpreter (TRITON_INTERPRET=1) against a dense reference.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax(scores, v, best, total, acc, PRECISION: tl.constexpr):
    """Fold one block's scores [rows, keys] and values [keys, D] into the running max, sum and output."""
    new_best = tl.maximum(best, tl.max(scores, 1))
    p = tl.exp(scores - new_best[:, None])
    fade = tl.exp(best - new_best)
    total = total * fade + tl.sum(p, 1)
    acc = acc * fade[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return new_best, total, acc


@triton.jit
def _row_parts(length, MAX_PARTS: tl.constexpr, PART_TOKENS: tl.constexpr):
    """`parts` in the kernels: the parts a context of `length` tokens is split into."""
    return tl.maximum(1, tl.minimum(MAX_PARTS, length // PART_TOKENS))


@triton.jit
def _decode_part(q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, lens_ptr, scale, seq, kv_head, split,
                 stride_qt, stride_qh, stride_ks, stride_kh, stride_tb,
                 MAX_PARTS: tl.constexpr, PART_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    """The query heads sharing K/V head kv_head, of sequence seq, over part `split` of its blocks (an even share of
    its context's parts; none past them; all of them for 1 part): (its row, the running max, sum and unnormalised
    output per head)."""
    row, length = tl.load(rows_ptr + seq), tl.load(lens_ptr + seq)
    g, d, t = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                other=0.0)
    num_blocks = tl.cdiv(length, BLOCK_SIZE)
    share = tl.cdiv(num_blocks, _row_parts(length, MAX_PARTS, PART_TOKENS))
    first = split * share
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for i in range(first, tl.minimum(first + share, num_blocks)):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        valid = i * BLOCK_SIZE + t < length
        offsets = (block * BLOCK_SIZE + t)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        best, total, acc = _online_softmax(scores, v, best, total, acc, PRECISION)
    return row, best, total, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, rows_ptr, tables_ptr, lens_ptr, scale,
                   stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PRECISION: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    row, best, total, acc = _decode_part(q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, lens_ptr, scale, seq, kv_head, 0,
                                         stride_qt, stride_qh, stride_ks, stride_kh, stride_tb,
                                         1, 1, GROUP, GROUP_PAD, BLOCK_SIZE, HEAD_DIM, PRECISION)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP)[:, None])


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr, rows_ptr, tables_ptr, lens_ptr, scale,
                         num_heads, stride_qt, stride_qh, stride_ks, stride_kh, stride_tb,
                         NUM_SPLITS: tl.constexpr, MAX_PARTS: tl.constexpr, PART_TOKENS: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    """One part of a context, kept with its log-sum-exp for the merge (NUM_SPLITS: the grid's parts, at least any
    of its contexts' own)."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, best, total, acc = _decode_part(q_ptr, k_ptr, v_ptr, rows_ptr, tables_ptr, lens_ptr, scale, seq, kv_head,
                                       split, stride_qt, stride_qh, stride_ks, stride_kh, stride_tb,
                                       MAX_PARTS, PART_TOKENS, GROUP, GROUP_PAD, BLOCK_SIZE, HEAD_DIM, PRECISION)
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    # an empty part (the last of an uneven split) weighs nothing in the merge: log-sum-exp -inf
    found = total > 0
    out = acc / tl.where(found, total, 1.0)[:, None]
    lse = tl.where(found, best + tl.log(tl.where(found, total, 1.0)), float("-inf"))
    parts = (seq * num_heads + heads) * NUM_SPLITS + split          # [B, heads, NUM_SPLITS] row-major
    tl.store(part_out_ptr + parts[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])
    tl.store(part_lse_ptr + parts, lse, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, rows_ptr, lens_ptr, num_heads, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, MAX_PARTS: tl.constexpr, PART_TOKENS: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    """out = the context's own parts' outputs weighted by their share of the whole softmax, from their
    log-sum-exps, summed one part after another: the same sums however many parts the grid ran."""
    seq, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    parts = _row_parts(tl.load(lens_ptr + seq), MAX_PARTS, PART_TOKENS)
    first = (seq * num_heads + head) * NUM_SPLITS            # [B, heads, NUM_SPLITS] row-major
    best = tl.load(part_lse_ptr + first)           # the first part is never empty: the maximum is finite
    for s in range(1, parts):
        best = tl.maximum(best, tl.load(part_lse_ptr + first + s))
    acc = tl.zeros([HEAD_DIM], tl.float32)
    total = tl.zeros([], tl.float32)
    for s in range(0, parts):
        weight = tl.exp(tl.load(part_lse_ptr + first + s) - best)
        acc += weight * tl.load(part_out_ptr + (first + s) * HEAD_DIM + d)
        total += weight
    out = acc / total
    row = tl.load(rows_ptr + seq)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, query_lens_ptr, context_starts_ptr, tables_ptr, scale,
                    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PRECISION: tl.constexpr):
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq)
    if tile * BLOCK_M >= query_len:
        return
    first_row, context_start = tl.load(starts_ptr + seq), tl.load(context_starts_ptr + seq)
    m, d, t = tile * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_SIZE)
    kv_head = head // GROUP
    q = tl.load(q_ptr + (first_row + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=(m < query_len)[:, None], other=0.0)
    positions = context_start + m                       # each query token's position in its sequence
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last = tl.minimum(context_start + (tile + 1) * BLOCK_M, context_start + query_len)   # positions it may see
    for i in range(0, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        key_positions = i * BLOCK_SIZE + t
        offsets = (block * BLOCK_SIZE + t)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + offsets, mask=(key_positions < last)[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=(key_positions < last)[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        scores = tl.where(key_positions[None, :] <= positions[:, None], scores, float("-inf"))
        best, total, acc = _online_softmax(scores, v, best, total, acc, PRECISION)
    out = acc / total[:, None]
    tl.store(out_ptr + (first_row + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(m < query_len)[:, None])


def supports(head_dim: int, block_size: int) -> bool:
    """The kernels tile a head and a block in powers of two of at least 16 (tl.arange and tl.dot)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))


def dot_precision(q: torch.Tensor) -> str:
    """float32 products in full precision (greedy output must match a float32 reference), not TF32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# a part of a split context holds at least this many tokens: shorter ones cost more to merge than they save
PART_TOKENS = 512


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def max_parts(kv_heads: int, num_multiprocessors: int) -> int:
    """The most parts a context is split into: enough for one sequence's programs to give every streaming
    multiprocessor two, rounded down to a power of two. A constant of the device and the model, not of the batch;
    1 without multiprocessors (off CUDA)."""
    programs = max(1, 2 * num_multiprocessors // kv_heads)
    return 1 << (programs.bit_length() - 1)


def parts(length: int, most: int, part_tokens: int = PART_TOKENS) -> int:
    """The parts a context of `length` tokens is split into: one per part_tokens, at least 1, at most `most`. A
    step's grid runs the most its longest context needs; the kernels give each context its own."""
    return max(1, min(most, length // part_tokens))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
           num_splits: int = 1, most_parts: int = 1, part_tokens: int = PART_TOKENS) -> None:
    """out[rows[b]] = attention of q[rows[b]] ([T, heads, D]) over the first context_lens[b] positions of
    sequence b's blocks (block_tables [B, max_blocks]) in the caches ([slots, kv_heads, D]); each context in
    `parts(its length, most_parts, part_tokens)` parts, over a grid of num_splits parts (at least the longest
    context's)."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    group = heads // kv_heads
    shape = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
                 HEAD_DIM=dim, PRECISION=dot_precision(q))
    if num_splits == 1:
        _decode_kernel[(len(rows), kv_heads)](
            q, k_cache, v_cache, out, rows, block_tables, context_lens, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), **shape)
        return
    part_out = torch.empty(len(rows), heads, num_splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(len(rows), heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(len(rows), kv_heads, num_splits)](
        q, k_cache, v_cache, part_out, part_lse, rows, block_tables, context_lens, scale, heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        NUM_SPLITS=num_splits, MAX_PARTS=most_parts, PART_TOKENS=part_tokens, **shape)
    _merge_splits_kernel[(len(rows), heads)](
        part_out, part_lse, out, rows, context_lens, heads, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, MAX_PARTS=most_parts, PART_TOKENS=part_tokens, HEAD_DIM=dim)


PREFILL_BLOCK_M = 64


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            query_starts: torch.Tensor, query_lens: torch.Tensor, context_starts: torch.Tensor,
            block_tables: torch.Tensor, max_query_len: int, block_size: int, scale: float) -> None:
    """For each sequence b: its query_lens[b] tokens at rows query_starts[b].. of q ([T, heads, D]), at positions
    context_starts[b].., attend causally to positions 0.. of its blocks (block_tables [B, max_blocks]), which
    already hold the chunk's own K/V."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    grid = (len(query_lens), heads, triton.cdiv(max_query_len, PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_starts, query_lens, context_starts, block_tables, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=heads // kv_heads, BLOCK_M=PREFILL_BLOCK_M, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        PRECISION=dot_precision(q))
