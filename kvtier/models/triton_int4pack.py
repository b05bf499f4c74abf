"""Rows of a weight in tinygemm's int4 layout (int4pack.py), dequantized in Triton: what cuBLAS multiplies prompt rows
by, since tinygemm's own product is built for a few rows (on an H100, prefill of the Llama-3.1-8B shape through it ran
at 0.06x bfloat16's speed).

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
