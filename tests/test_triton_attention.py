"""The Triton paged attention kernels against a dense reference: ragged lengths, scattered blocks, GQA groups of 1,
3 and 4, block sizes 16 and 64. On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by the test
command before Triton is imported); on CUDA compiled (gpu marker)."""
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is installed by the test command")
from kvtier.models import triton_attention  # noqa: E402

DIM = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("on CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)


def reference(q, k, v, scale):
    """q [n, H, D] at the last n positions of k, v [L, KVH, D]: causal softmax attention in float64."""
    n, length = q.shape[0], k.shape[0]
    k, v = (x.double().repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def setup(work, heads, kv_heads, bs, seed):
    """A pool holding every sequence's context in every other block, and the chunks' queries. work: per sequence
    (tokens before this step, tokens this step)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * sum(-(-(s + n) // bs) for s, n in work) + 2
    k_cache = torch.randn(num_blocks * bs, kv_heads, DIM, generator=gen)
    v_cache = torch.randn(num_blocks * bs, kv_heads, DIM, generator=gen)
    free = [*range(1, num_blocks, 2), *range(0, num_blocks, 2)]
    tables = []
    for start, n in work:
        count = -(-(start + n) // bs)
        tables.append(free[:count])
        free = free[count:]
    q = torch.randn(sum(n for _, n in work), heads, DIM, generator=gen)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    expected, row = [], 0
    for (start, n), table in zip(work, tables):
        slots = [table[p // bs] * bs + p % bs for p in range(start + n)]
        expected.append(reference(q[row:row + n], k_cache[slots], v_cache[slots], DIM ** -0.5))
        row += n
    return q, k_cache, v_cache, block_tables, torch.cat(expected)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_decode_kernel_matches_the_reference(bs, heads, kv_heads):
    work = [(0, 1), (bs - 1, 1), (2 * bs + 5, 1), (3 * bs, 1)]
    q, k_cache, v_cache, tables, expected = setup(work, heads, kv_heads, bs, seed=bs + heads)
    q, k_cache, v_cache, tables = (x.to(DEVICE) for x in (q, k_cache, v_cache, tables))
    out = torch.zeros_like(q)
    triton_attention.decode(q, k_cache, v_cache, out, torch.arange(len(work), device=DEVICE), tables,
                            torch.tensor([s + n for s, n in work], device=DEVICE), bs, DIM ** -0.5)
    assert torch.allclose(out.cpu().double(), expected, atol=1e-4)


@pytest.mark.parametrize("most", [2, 5])
@pytest.mark.parametrize("bs, heads, kv_heads", [(16, 8, 2), (64, 6, 2), (16, 4, 4)])
def test_split_decode_matches_the_reference(most, bs, heads, kv_heads):
    """Contexts split into parts of at least a block and merged: one part (shorter than a block), parts of an uneven
    split (an empty last one: 11 blocks in 5 parts of 3), at most `most` parts, over a grid of more than any needs."""
    work = [(0, 1), (bs - 1, 1), (3 * bs + 5, 1), (11 * bs - 2, 1)]
    q, k_cache, v_cache, tables, expected = setup(work, heads, kv_heads, bs, seed=most + bs + heads)
    q, k_cache, v_cache, tables = (x.to(DEVICE) for x in (q, k_cache, v_cache, tables))
    out = torch.zeros_like(q)
    rows = torch.tensor([3, 0, 2, 1], device=DEVICE)          # rows in any order
    triton_attention.decode(q, k_cache, v_cache, out, rows, tables[[3, 0, 2, 1]],
                            torch.tensor([s + n for s, n in work], device=DEVICE)[[3, 0, 2, 1]], bs, DIM ** -0.5,
                            num_splits=most + 1, most_parts=most, part_tokens=bs)
    assert torch.allclose(out.cpu().double(), expected, atol=1e-4)


def test_a_rows_decode_sums_alike_in_any_batch():
    """A context's attention is the same to the bit whatever decodes beside it and however many parts the step's
    grid runs (its longest context's): a verify step's rows score as their decode steps would."""
    bs, heads, kv_heads, most = 16, 8, 2, 4
    work = [(5 * bs + 3, 1), (bs - 1, 1), (2 * bs, 1), (9 * bs + 7, 1)]
    q, k_cache, v_cache, tables, _ = setup(work, heads, kv_heads, bs, seed=7)
    q, k_cache, v_cache, tables = (x.to(DEVICE) for x in (q, k_cache, v_cache, tables))
    lens = torch.tensor([s + n for s, n in work], device=DEVICE)

    def decode(which: list[int]) -> torch.Tensor:
        out = torch.zeros_like(q)
        grid = triton_attention.parts(int(lens[which].max()), most, part_tokens=bs)
        triton_attention.decode(q, k_cache, v_cache, out, torch.tensor(which, device=DEVICE), tables[which],
                                lens[which], bs, DIM ** -0.5, num_splits=grid, most_parts=most, part_tokens=bs)
        return out[which]
    together = decode([0, 1, 2, 3])
    for i in range(len(work)):
        assert torch.equal(decode([i])[0], together[i]), i
    assert torch.equal(decode([1, 2]), together[[1, 2]])


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_prefill_kernel_matches_the_reference(bs, heads, kv_heads):
    # a first chunk, chunks after a cached prefix (one longer than a tile of queries), and a one-token chunk
    work = [(0, 20), (bs + 3, 70), (2 * bs, 5), (5, 1)]
    q, k_cache, v_cache, tables, expected = setup(work, heads, kv_heads, bs, seed=bs * heads)
    q, k_cache, v_cache, tables = (x.to(DEVICE) for x in (q, k_cache, v_cache, tables))
    out = torch.zeros_like(q)
    lens = [n for _, n in work]
    starts = [sum(lens[:i]) for i in range(len(work))]
    triton_attention.prefill(q, k_cache, v_cache, out, torch.tensor(starts, device=DEVICE),
                             torch.tensor(lens, device=DEVICE), torch.tensor([s for s, _ in work], device=DEVICE),
                             tables, max(lens), bs, DIM ** -0.5)
    assert torch.allclose(out.cpu().double(), expected, atol=1e-4)


def test_shapes_the_kernels_cannot_tile_are_left_to_the_other_paths():
    assert triton_attention.supports(64, 16) and triton_attention.supports(128, 64)
    assert not triton_attention.supports(80, 64) and not triton_attention.supports(64, 8)
