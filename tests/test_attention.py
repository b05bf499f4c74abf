"""Attention over the paged pool against a dense reference: ragged lengths, scattered and consecutive blocks,
paged-out holes, GQA, block sizes 16 and 64."""
import itertools

import pytest
import torch

from kvtier.engine.runner import slot_runs
from kvtier.kv.state import NOT_RESIDENT
from kvtier.models import attention
from kvtier.models.attention import (CONTEXT_SEGMENT, CPU_DECODE_APART, AttentionMetadata, DecodeGroup, PrefillSeq,
                                     paged_attention)

HEADS, KV_HEADS, DIM = 6, 2, 16
RUNS = 17      # blocks of a scattered context: as many runs
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference(q, k, v, scale):
    """q [n, H, D] at the last n positions of k, v [L, KVH, D]: causal softmax attention in float64."""
    n, length = q.shape[0], k.shape[0]
    k, v = (x.double().repeat_interleave(HEADS // KV_HEADS, 1) for x in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


def block_tables(num_blocks, lengths, bs, consecutive):
    """Consecutive blocks, or every other block (no two of a table adjacent in the pool)."""
    free = list(range(num_blocks)) if consecutive else [*range(0, num_blocks, 2), *range(1, num_blocks, 2)]
    tables = []
    for length in lengths:
        n = -(-length // bs)
        tables.append(free[:n])
        free = free[n:]
    return tables


@pytest.mark.parametrize("decodes", [1, 3])
def test_a_lone_short_decode_reads_its_context_where_it_lies(monkeypatch, decodes):
    """On CPU the step's only decode attends where its K/V lies, however short its context; short contexts of
    several decodes share the gathered call. Either way the values are the dense reference's."""
    bs, scale, length = 16, DIM ** -0.5, 3 * 16 + 5
    gen = torch.Generator().manual_seed(decodes)
    k_cache, v_cache = (torch.randn(16 * bs, KV_HEADS, DIM, generator=gen) for _ in range(2))
    q, k, v = (torch.randn(decodes, heads, DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    tables = block_tables(16, [length] * decodes, bs, consecutive=False)
    slots = [[table[p // bs] * bs + p % bs for p in range(length)] for table in tables]
    apart = []
    segment_parts = attention._segment_parts_cpu
    monkeypatch.setattr(attention, "_segment_parts_cpu", lambda *a: apart.append(1) or segment_parts(*a))
    meta = AttentionMetadata(positions=torch.zeros(decodes, dtype=torch.long),
                             slot_mapping=torch.tensor([s[-1] for s in slots]), prefills=[],
                             decode=DecodeGroup(list(range(decodes)), [slot_runs(t, length, bs) for t in tables]),
                             block_size=bs)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    assert len(apart) == (decodes == 1)
    for i in range(decodes):
        want = reference(q[i:i + 1], k_cache[slots[i]], v_cache[slots[i]], scale)
        assert torch.allclose(out[i:i + 1].double(), want, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("layout", ["consecutive", "scattered", "holes"])
def test_prefill_chunks_and_decodes_match_a_dense_reference(device, bs, layout):
    gen = torch.Generator().manual_seed(bs)
    scale = DIM ** -0.5
    # (tokens before this step, tokens this step): prefill chunks over ragged prefixes, then decodes
    work = [(0, 37), (5 * bs + 3, 29), (RUNS * bs + 7, 40), (3 * bs, 1), (7 * bs + 11, 1), (RUNS * bs + 20, 1),
            (CPU_DECODE_APART + 5, 1)]
    num_blocks = sum(-(-(s + n) // bs) for s, n in work) + 4
    k_cache = torch.randn(num_blocks * bs, KV_HEADS, DIM, generator=gen).to(device)
    v_cache = torch.randn(num_blocks * bs, KV_HEADS, DIM, generator=gen).to(device)
    tables = block_tables(num_blocks, [s + n for s, n in work], bs, layout == "consecutive")
    total = sum(n for _, n in work)
    q = torch.randn(total, HEADS, DIM, generator=gen).to(device)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen).to(device)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen).to(device)
    slot_mapping, prefills, decode_rows, decode_runs, expected, row = [], [], [], [], [], 0
    for (start, n), table in zip(work, tables):
        slots = [table[p // bs] * bs + p % bs for p in range(start + n)]
        slot_mapping += slots[start:]
        logical_k = torch.cat([k_cache[slots[:start]], k[row:row + n]])
        logical_v = torch.cat([v_cache[slots[:start]], v[row:row + n]])
        expected.append(reference(q[row:row + n].cpu(), logical_k.cpu(), logical_v.cpu(), scale))
        if n == 1:
            decode_rows.append(row)
            decode_runs.append(slot_runs(table, start + n, bs))
        else:
            paged_out = None
            if layout == "holes" and start >= 2 * bs:     # every other full block paged out to host memory
                holes = [i for i in range(start // bs) if i % 2]
                out_slots = [table[i] * bs + j for i in holes for j in range(bs)]
                paged_out = torch.stack([torch.stack([c[out_slots].cpu()]) for c in (k_cache, v_cache)])
                table = [NOT_RESIDENT if i in holes else b for i, b in enumerate(table)]
            prefills.append(PrefillSeq(row, n, slot_runs(table, start, bs), table[:-(-(start + n) // bs)], paged_out))
        row += n
    meta = AttentionMetadata(positions=torch.zeros(total, dtype=torch.long, device=device),
                             slot_mapping=torch.tensor(slot_mapping, device=device), prefills=prefills,
                             decode=DecodeGroup(decode_rows, decode_runs), block_size=bs)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale).cpu()
    assert torch.allclose(out.double(), torch.cat(expected), atol=1e-4)
    if layout == "scattered":     # contexts in many pieces, joined
        assert len(prefills[2].prefix_runs) >= RUNS and max(map(len, decode_runs)) >= RUNS


def test_on_cpu_a_verify_steps_rows_read_their_context_once(monkeypatch):
    """A verify step's 9 rows (its last token and a draft of 8) after 700 tokens in scattered blocks, beside a decode
    of a long context: each row attends causally up to its own position, as the dense reference does, and the
    verify step's context is read in one call for all its rows (as a prompt chunk after a cached prefix), not in
    one per row."""
    bs, n, scale = 16, 9, DIM ** -0.5
    gen = torch.Generator().manual_seed(7)
    work = [(700, n), (CPU_DECODE_APART + 5, 1)]
    num_blocks = sum(-(-(s + m) // bs) for s, m in work) + 4
    k_cache, v_cache = (torch.randn(num_blocks * bs, KV_HEADS, DIM, generator=gen) for _ in range(2))
    tables = block_tables(num_blocks, [s + m for s, m in work], bs, consecutive=False)
    q, k, v = (torch.randn(n + 1, heads, DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    slot_mapping, runs, expected, row = [], [], [], 0
    for (start, m), table in zip(work, tables):
        slots = [table[p // bs] * bs + p % bs for p in range(start + m)]
        slot_mapping += slots[start:]
        runs += [slot_runs(table, start + j + 1, bs) for j in range(m)]
        expected.append(reference(q[row:row + m], torch.cat([k_cache[slots[:start]], k[row:row + m]]),
                                  torch.cat([v_cache[slots[:start]], v[row:row + m]]), scale))
        row += m
    reads = []
    segment_parts = attention._segment_parts_cpu
    monkeypatch.setattr(attention, "_segment_parts_cpu", lambda *a: reads.append(len(a[2])) or segment_parts(*a))
    meta = AttentionMetadata(positions=torch.zeros(n + 1, dtype=torch.long), slot_mapping=torch.tensor(slot_mapping),
                             prefills=[], block_size=bs, decode=DecodeGroup(list(range(n + 1)), runs, verify=[
                                 (0, n, slot_runs(tables[0], work[0][0], bs))]))
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.allclose(out.double(), torch.cat(expected), atol=1e-4)
    assert reads == [1, 1]      # one segment read once for the verify step, one for the decode


@pytest.mark.parametrize("prompt_dtype", [None, torch.bfloat16], ids=str)
@pytest.mark.parametrize("length", [700, CONTEXT_SEGMENT + 300])
def test_on_cpu_a_context_computes_the_same_wherever_its_blocks_lie(length, prompt_dtype):
    """A prompt chunk after a cached prefix (attending in the queries' dtype or in bfloat16), and a decode, over the
    same context in consecutive blocks and in scattered ones: bitwise the same (a context is cut into segments at
    fixed positions, never where its blocks happen to lie), over one segment and over two."""
    bs, chunk, scale = 16, 9, DIM ** -0.5
    gen = torch.Generator().manual_seed(length)
    logical_k, logical_v = (torch.randn(length + chunk, KV_HEADS, DIM, generator=gen) for _ in range(2))
    q, k, v = (torch.randn(chunk + 1, heads, DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    blocks = -(-(length + chunk + 1) // bs)
    outs = []
    for table in (list(range(blocks)), [b for pair in zip(range(blocks, 2 * blocks), range(blocks)) for b in pair][:blocks]):
        slots = [table[p // bs] * bs + p % bs for p in range(length + chunk + 1)]
        k_cache, v_cache = torch.zeros(2 * blocks * bs, KV_HEADS, DIM), torch.zeros(2 * blocks * bs, KV_HEADS, DIM)
        k_cache[slots[:length + chunk]], v_cache[slots[:length + chunk]] = logical_k, logical_v
        meta = AttentionMetadata(positions=torch.zeros(chunk + 1, dtype=torch.long),
                                 slot_mapping=torch.tensor(slots[length:length + chunk] + [slots[-1]]),
                                 prefills=[PrefillSeq(0, chunk, slot_runs(table, length, bs), table,
                                                      dtype=prompt_dtype)],
                                 decode=DecodeGroup([chunk], [slot_runs(table, length + chunk + 1, bs)]), block_size=bs)
        outs.append(paged_attention(q, k, v, k_cache, v_cache, meta, scale))
    assert torch.equal(*outs)


@pytest.mark.parametrize("split", [16, 23])
def test_in_a_float16_pool_a_chunk_attends_to_its_own_kv_as_the_next_chunk_reads_them(split):
    """A float16 pool (--kv-cache-dtype float16) keeps K/V rounded to float16; a prompt chunk attends to its own K/V
    rounded so too, as the chunk after it reads them from the pool, and as a later decode step (or llama.cpp's batch)
    does: a prompt computed in one chunk or in two gives its rows alike, to float32's rounding of sums (attending to
    its own unrounded K/V, the rows differ by float16's rounding: 5-7e-4)."""
    bs, n, scale = 16, 40, DIM ** -0.5
    gen = torch.Generator().manual_seed(split)
    q, k, v = (torch.randn(n, heads, DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    table = [0, 1, 2]
    outs = []
    for chunks in ([(0, n)], [(0, split), (split, n)]):
        k_cache, v_cache = (torch.zeros(4 * bs, KV_HEADS, DIM, dtype=torch.float16) for _ in range(2))
        out = []
        for a, b in chunks:
            meta = AttentionMetadata(positions=torch.arange(a, b), slot_mapping=torch.arange(a, b),
                                     prefills=[PrefillSeq(0, b - a, slot_runs(table, a, bs), table)], decode=None,
                                     block_size=bs)
            out.append(paged_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, meta, scale))
        outs.append(torch.cat(out))
    one, two = outs
    assert (one - two).abs().max() < 1e-5
    assert (one - reference(q, k.half().float(), v.half().float(), scale)).abs().max() < 1e-5


@pytest.mark.parametrize("cuts", [[16], [23], [300], list(range(256, 276))], ids=["16", "23", "300", "one-row"])
def test_on_cpu_a_prompt_chunk_attends_in_the_dtype_the_decoder_names(cuts):
    """PrefillSeq.dtype (the runner's choice: the decoder's prompt rows' products' dtype) is the flash kernel's on
    CPU: a prompt in bfloat16's rounding of the float32 attention (not float32's own), bitwise the same whether
    computed in one chunk or cut into several (a cold prompt, and turns after its cached first part), one-row chunks
    among them (the kernel takes a lone row otherwise than among others), over more keys than one of the kernel's
    blocks and more rows than one call's. Heads of 64, SmolLM2's: the kernel's lone row rounds alike at 16."""
    bs, n, dim = 16, 600, 64
    assert n > attention.PROMPT_KEY_BLOCK and n > attention.PROMPT_QUERY_BLOCK
    gen = torch.Generator().manual_seed(len(cuts) + cuts[0])
    q, k, v = (torch.randn(n, heads, dim, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    table = list(range(-(-n // bs)))
    outs = {}
    for dtype, chunked in itertools.product((None, torch.bfloat16), (False, True)):
        ends = (cuts if chunked else []) + [n]
        k_cache, v_cache = (torch.zeros(len(table) * bs, KV_HEADS, dim) for _ in range(2))
        out = []
        for a, b in zip([0] + ends[:-1], ends):
            meta = AttentionMetadata(positions=torch.arange(a, b), slot_mapping=torch.arange(a, b),
                                     prefills=[PrefillSeq(0, b - a, slot_runs(table, a, bs), table, dtype=dtype)],
                                     decode=None, block_size=bs)
            out.append(paged_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, meta, dim ** -0.5))
        outs[dtype, chunked] = torch.cat(out)
    want = reference(q, k, v, dim ** -0.5)
    for chunked in (False, True):
        assert (outs[None, chunked].double() - want).abs().max() < 1e-5
        assert 1e-4 < (outs[torch.bfloat16, chunked].double() - want).abs().max() < 2e-2
    assert torch.equal(outs[torch.bfloat16, False], outs[torch.bfloat16, True])


def test_where_only_math_takes_grouped_heads_each_kv_head_is_repeated_for_its_group():
    """A masked or float32 call with grouped heads gets each K/V head repeated for its query heads, which computes
    what enable_gqa does; a bfloat16 causal call keeps its grouped heads (FlashAttention takes them)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 10, 16, generator=gen) for heads in (6, 2, 2))
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    *inputs, gqa = attention.plan_free_inputs(q, k, v, True, {"attn_mask": mask})
    assert not gqa and inputs[1].shape[1] == inputs[2].shape[1] == 6
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(torch.nn.functional.scaled_dot_product_attention(*inputs, attn_mask=mask), want, atol=1e-6)
    halves = [x.bfloat16() for x in (q, k, v)]
    *same, gqa = attention.plan_free_inputs(*halves, True, {"is_causal": True})
    assert gqa and all(a is b for a, b in zip(same, halves))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_sdpa_on_cuda_takes_no_backend_that_plans_per_shape(dtype):
    """cuDNN's SDPA builds a plan for each new shape (70-110 ms a first chunk of a new length on an H200): sdpa's
    choice, for a first chunk's causal call with grouped heads and for a masked one, is FlashAttention or the
    memory-efficient kernel (not math, which builds the whole score matrix), and its result is attention's."""
    from torch.nn.attention import SDPBackend
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 300, 64, generator=gen).to("cuda", dtype) for heads in (8, 2, 2))
    mask = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        *inputs, gqa = attention.plan_free_inputs(q, k, v, True, kwargs)
        with attention.plan_free():
            chosen = torch._fused_sdp_choice(*inputs, enable_gqa=gqa, **kwargs)
        assert chosen in (SDPBackend.FLASH_ATTENTION.value, SDPBackend.EFFICIENT_ATTENTION.value), kwargs
        want = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), enable_gqa=True,
                                                                **kwargs)
        got = attention.sdpa(q, k, v, enable_gqa=True, **kwargs)
        assert (got.double() - want).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-4), kwargs
