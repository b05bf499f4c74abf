"""A weight in tinygemm's int4 layout (int4pack.py), in Triton: rows dequantized, what cuBLAS multiplies prompt rows
by, since tinygemm's own product is built for a few rows (on an H100, prefill of the Llama-3.1-8B shape through it ran
at 0.06x bfloat16's speed); and `product`, a candidate for decode rows beside tinygemm (`kvtier bench kernels`):
tinygemm read a 4096x4096 weight at 596 GB/s for one row on an H100, about a fifth of the card's bandwidth, and
`product` splits K over more programs, each rounding a row alike whatever rows stand beside it.

The layout is `torch.ops.aten._convert_weight_to_int4pack`'s on CUDA (aten's int4mm.cu,
matrix_to_m16n8k16_Bint4_layout): int32 words [N / 8, K / (16 * inner_k_tiles), 32, inner_k_tiles / 2]. Word
(n_tile, k_outer, t, i) holds row n_tile * 8 + t // 4, k-tiles 2i and 2i + 1 of k_outer's inner_k_tiles, each a
tile of 16 weights; of each tile, bytes t % 4 and t % 4 + 4 (two weights each). Its nibble 4 * low + 2 * second +
half is weight 2 * byte + low of k-tile 2i + second, byte t % 4 + 4 * half. A weight is (q - 8) * scale + zero, per
group of 32 along K.

Tested on CPU through Triton's interpreter against a layout written by the test, which a CUDA test checks against
aten's conversion.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.models.int4pack import INNER_K_TILES
from kvtier.models.packed import GROUP
from kvtier.models.triton_attention import dot_precision, multiprocessors

BLOCK_N, BLOCK_K = 16, 128


@triton.jit
def _dequantize_kernel(ids_ptr, out_ptr, packed_ptr, scales_zeros_ptr, num_ids, N, K, s_out,
                       INNER_K_TILES: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (i < num_ids)[:, None] & (k < K)[None, :]
    n = tl.load(ids_ptr + i, mask=i < num_ids, other=0)[:, None]
    tile, byte, low = k // 16, k % 16 // 2, k % 2
    k_outer, inner = tile // INNER_K_TILES, tile % INNER_K_TILES
    t = 4 * (n % 8) + (byte % 4)[None, :]
    word = (((n // 8) * (K // (16 * INNER_K_TILES)) + k_outer[None, :]) * 32 + t) * (INNER_K_TILES // 2) \
        + (inner // 2)[None, :]
    nibble = 4 * low + 2 * (inner % 2) + byte // 4
    q = tl.load(packed_ptr + word, mask=mask, other=0) >> (4 * nibble)[None, :] & 15
    group = ((k // GROUP)[None, :] * N + n) * 2
    scale = tl.load(scales_zeros_ptr + group, mask=mask, other=0).to(tl.float32)
    zero = tl.load(scales_zeros_ptr + group + 1, mask=mask, other=0).to(tl.float32)
    w = (q.to(tl.float32) - 8) * scale + zero
    tl.store(out_ptr + i.to(tl.int64)[:, None] * s_out + k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, ids: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """Rows ids of the weight (packed, scales_and_zeros [K / group, N, 2]) into out [len(ids), K]."""
    ids = ids.to(device=packed.device, dtype=torch.int32).reshape(-1)
    num_groups, n, _ = scales_and_zeros.shape
    k = num_groups * group
    if len(ids):
        grid = (triton.cdiv(len(ids), BLOCK_N), triton.cdiv(k, BLOCK_K))
        _dequantize_kernel[grid](ids, out, packed, scales_and_zeros, len(ids), n, k, out.stride(0),
                                 INNER_K_TILES=packed.shape[-1] * 2, GROUP=group, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 enable_fp_fusion=False)
    return out


# product's tiles: NT tiles of 8 rows of the weight, a k_outer (128 weights along K, tinygemm's 8 inner K tiles: the
# kernel's index arithmetic is written for them) per step, BLOCK_M activation rows (tensor cores multiply 16 at least)
NT, BLOCK_M, K_OUTER = 4, 16, 16 * INNER_K_TILES
SPLIT_K_WAVES = 4        # programs for one tile of rows, per multiprocessor: what decode_splits splits K for
ROWS_PER_LAUNCH = 64     # rows one launch multiplies: its float32 partial sums [splits, rows, N] stay a few MB in any
                         # batch (a verify step's graph takes up to 512 rows)


@triton.jit
def _product_kernel(x_ptr, packed_ptr, scales_zeros_ptr, partial_ptr, M, N, K, s_xm, k_outer_per_split,
                    NT: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """Rows x [M, K] by the weight's rows of NT n-tiles, over one split of K, into partial [splits, M, N] (float32).
    A k_outer's words are laid out [n-tile, 8 rows r, 4 columns c, 4 i] (t = 4r + c), 8 nibbles each (j = 4 low +
    2 second + half): weight k = 32i + 16 second + 8 half + 2c + low of row 8 n-tile + r, of group 4 k_outer + i. The
    weight is dequantized in this order and x gathered in it, so no tile is permuted."""
    nt = tl.program_id(0) * NT + tl.arange(0, NT)
    split = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    r, c, i, j = tl.arange(0, 8), tl.arange(0, 4), tl.arange(0, 4), tl.arange(0, 8)
    word = (4 * r[:, None, None] + c[None, :, None]) * 4 + i[None, None, :]                       # [8, 4, 4]
    low, second, half = j // 4, j // 2 % 2, j % 2
    k_in = (32 * i[None, :, None] + 16 * second[None, None, :] + 8 * half[None, None, :]
            + 2 * c[:, None, None] + low[None, None, :])                                           # [4 c, 4 i, 8 j]
    k_in = tl.reshape(k_in, [128])
    n = nt[:, None] * 8 + r[None, :]                                                               # [NT, 8]
    num_k_outer = K // 128
    acc = tl.zeros([BLOCK_M, NT * 8], dtype=tl.float32)
    for step in range(k_outer_per_split):
        ko = split * k_outer_per_split + step
        words = tl.load(packed_ptr + ((nt[:, None, None, None] * num_k_outer + ko) * 128 + word[None]))
        q = words[:, :, :, :, None] >> (4 * j)[None, None, None, None, :] & 15                     # [NT, 8, 4, 4, 8]
        group = ((ko * 4 + i)[None, None, :] * N + n[:, :, None]) * 2                             # [NT, 8, 4 i]
        scale = tl.load(scales_zeros_ptr + group).to(tl.float32)[:, :, None, :, None]
        zero = tl.load(scales_zeros_ptr + group + 1).to(tl.float32)[:, :, None, :, None]
        w = tl.reshape(((q.to(tl.float32) - 8) * scale + zero).to(x_ptr.dtype.element_ty), [NT * 8, 128])
        xs = tl.load(x_ptr + m[:, None] * s_xm + (ko * 128 + k_in)[None, :], mask=(m < M)[:, None], other=0)
        acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)
    out = partial_ptr + (split * M + m[:, None]).to(tl.int64) * N + tl.reshape(n, [NT * 8])[None, :]
    tl.store(out, acc, mask=(m < M)[:, None])


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, size, splits, BLOCK: tl.constexpr):
    """out = the splits' partial products summed in order, so that a row rounds alike whatever its batch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        total += tl.load(partial_ptr + s * size + offs, mask=offs < size, other=0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=offs < size)


def splits_for(n: int, k: int, programs: int) -> int:
    """How many parts K is split into: the fewest (a power of two dividing K's k_outers) that give `programs`
    programs for one tile of rows. A function of the weight's shape alone, never of the rows'."""
    k_outers, splits = k // K_OUTER, 1
    while n // (NT * 8) * splits < programs and splits * 2 <= k_outers and k_outers % (splits * 2) == 0:
        splits *= 2
    return splits


def decode_splits(n: int, k: int, device: torch.device) -> int:
    """The parts `product` splits K into for a weight of N rows and K columns on this device (splits_for)."""
    return splits_for(n, k, SPLIT_K_WAVES * multiprocessors(device))


def takes(n: int, k: int) -> bool:
    """Whether `product` multiplies a weight of N rows and K columns (whole tiles of its programs)."""
    return n % (NT * 8) == 0 and k % K_OUTER == 0


def product(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, x: torch.Tensor,
            splits: int) -> torch.Tensor:
    """x [M, K] by the weight (packed, scales_and_zeros [K / group, N, 2]; group 32, N a multiple of NT * 8) → [M, N]
    in x's dtype, K split into `splits` parts (splits_for)."""
    num_groups, n, _ = scales_and_zeros.shape
    m, k = x.shape
    if group != GROUP or num_groups * group != k or not takes(n, k) or k % (K_OUTER * splits) \
            or packed.shape != (n // 8, k // K_OUTER, 32, INNER_K_TILES // 2):
        raise ValueError(f"product takes groups of 32, 8 inner K tiles, N a multiple of {NT * 8} and K of "
                         f"{K_OUTER * splits}")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(splits, min(m, ROWS_PER_LAUNCH), n, dtype=torch.float32, device=x.device)
    for first in range(0, m, ROWS_PER_LAUNCH):      # each row computed alike in whichever launch it falls
        rows = x[first:first + ROWS_PER_LAUNCH]
        grid = (n // (NT * 8), splits, triton.cdiv(len(rows), BLOCK_M))
        _product_kernel[grid](rows, packed, scales_and_zeros, partial, len(rows), n, k, rows.stride(0),
                              k // (K_OUTER * splits), NT=NT, BLOCK_M=BLOCK_M, PRECISION=dot_precision(x),
                              enable_fp_fusion=False)
        size = len(rows) * n
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](partial, out[first:first + len(rows)], size, splits,
                                                       BLOCK=1024)
    return out
