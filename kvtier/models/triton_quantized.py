"""Products with GGUF's quantized weights on CUDA, in Triton, over the layout packed.py gives them: the weights are
dequantized tile by tile in registers, never in memory.

- `product(x, w)`: x [rows, K] @ W.T, for decode rows. A program serves BLOCK_N outputs of BLOCK_M rows and walks
  K, dequantizing a [BLOCK_N, BLOCK_K] tile of W per step into x's dtype for one tl.dot, so W's bytes are read
  once per BLOCK_M rows: a decode step reads 4.5-8.5 bits per weight where bfloat16 weights take 16.
  A row's sums run in the same order whatever the other rows are, so its result does not depend on its batch.
- `dequantize(w, ids)`: rows of W in its dtype: an embedding lookup, or a slice of W that cuBLAS then multiplies by
  prompt rows (many rows: a dense product is faster than one that dequantizes each tile once per 16 rows).

Tested on CPU through Triton's interpreter (TRITON_INTERPRET=1) against the gguf package's dequantization.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.models.packed import PackedWeight

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64      # BLOCK_K divides the K-quants' 256 and is a multiple of 32


@triton.jit
def _tile(q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, rows, k, mask, s_q, s_qh, s_d, s_dmin, s_sub,
          TYPE: tl.constexpr):
    """W[rows, k] in float32 (rows [BLOCK_N] int64, k [BLOCK_K]); TYPE: the GGML type number."""
    r, c = rows[:, None], k[None, :]
    if TYPE == 8:       # Q8_0
        q = tl.load(q_ptr + r * s_q + c, mask=mask, other=0).to(tl.float32)
        w = q * tl.load(d_ptr + r * s_d + c // 32, mask=mask, other=0).to(tl.float32)
    else:
        nibbles = tl.load(q_ptr + r * s_q + (c // 32 * 16 + c % 16), mask=mask, other=0).to(tl.int32)
        q = (nibbles >> (c % 32 // 16 * 4)) & 15
        if TYPE == 2:       # Q4_0
            w = (q - 8).to(tl.float32) * tl.load(d_ptr + r * s_d + c // 32, mask=mask, other=0).to(tl.float32)
        elif TYPE == 3:     # Q4_1
            d = tl.load(d_ptr + r * s_d + c // 32, mask=mask, other=0).to(tl.float32)
            w = q.to(tl.float32) * d + tl.load(dmin_ptr + r * s_dmin + c // 32, mask=mask, other=0).to(tl.float32)
        elif TYPE == 14:    # Q6_K
            high = tl.load(qh_ptr + r * s_qh + c // 4, mask=mask, other=0).to(tl.int32)
            q = q | (((high >> (c % 4 * 2)) & 3) << 4)
            d = tl.load(d_ptr + r * s_d + c // 256, mask=mask, other=0).to(tl.float32)
            scale = d * tl.load(sub_ptr + r * s_sub + c // 16, mask=mask, other=0).to(tl.float32)
            w = scale * (q - 32).to(tl.float32)
        else:               # Q4_K, Q5_K
            if TYPE == 13:
                high = tl.load(qh_ptr + r * s_qh + c // 8, mask=mask, other=0).to(tl.int32)
                q = q | (((high >> (c % 8)) & 1) << 4)
            d = tl.load(d_ptr + r * s_d + c // 256, mask=mask, other=0).to(tl.float32)
            dmin = tl.load(dmin_ptr + r * s_dmin + c // 256, mask=mask, other=0).to(tl.float32)
            sc = tl.load(sub_ptr + r * s_sub + c // 32 * 2, mask=mask, other=0).to(tl.float32)
            m = tl.load(sub_ptr + r * s_sub + c // 32 * 2 + 1, mask=mask, other=0).to(tl.float32)
            w = (d * sc) * q.to(tl.float32) - dmin * m
    return w


@triton.jit
def _product_kernel(x_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, M, N, K, s_x, s_y,
                    s_q, s_qh, s_d, s_dmin, s_sub, TYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * s_x + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :],
                    other=0.0)
        w = _tile(q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, rows, k, (n < N)[:, None] & (k < K)[None, :],
                  s_q, s_qh, s_d, s_dmin, s_sub, TYPE)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    tl.store(y_ptr + m.to(tl.int64)[:, None] * s_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _dequantize_kernel(ids_ptr, out_ptr, q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, num_ids, K, s_out,
                       s_q, s_qh, s_d, s_dmin, s_sub, TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (i < num_ids)[:, None] & (k < K)[None, :]
    rows = tl.load(ids_ptr + i, mask=i < num_ids, other=0).to(tl.int64)
    w = _tile(q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, rows, k, mask, s_q, s_qh, s_d, s_dmin, s_sub, TYPE)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * s_out + k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def _strides(w: PackedWeight) -> list[int]:
    return [f.stride(0) if f.dim() == 2 else 0 for f in w.fields]


def product(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [rows, in_features] @ W.T, in x's dtype."""
    x = x.contiguous()
    rows = x.shape[0]
    y = x.new_empty(rows, w.out_features)
    if rows == 0:
        return y
    grid = (triton.cdiv(w.out_features, BLOCK_N), triton.cdiv(rows, BLOCK_M))
    _product_kernel[grid](x, y, *w.fields, rows, w.out_features, w.in_features, x.stride(0), y.stride(0),
                          *_strides(w), TYPE=w.ggml_type, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y


def dequantize(w: PackedWeight, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ids of W, dequantized: [len(ids), in_features] in w.dtype (into out when given)."""
    ids = ids.to(device=w.q.device, dtype=torch.int32).reshape(-1)
    out = torch.empty(len(ids), w.in_features, dtype=w.dtype, device=w.q.device) if out is None else out
    if len(ids):
        grid = (triton.cdiv(len(ids), BLOCK_N), triton.cdiv(w.in_features, BLOCK_K))
        _dequantize_kernel[grid](ids, out, *w.fields, len(ids), w.in_features, out.stride(0), *_strides(w),
                                 TYPE=w.ggml_type, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
