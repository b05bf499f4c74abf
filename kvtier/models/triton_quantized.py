"""Products with GGUF's quantized weights on CUDA, in Triton, over the layout packed.py gives them: the weights are
dequantized tile by tile in registers, never in memory.

- `product(x, w)`: x [rows, K] @ W.T, for decode rows. A program serves BLOCK_N outputs of BLOCK_M rows and walks
  K, BLOCK_K weights a step: per output row it reads BLOCK_K / 2 consecutive bytes of nibbles (packed.py's layout:
  in each group of 32 weights, byte i holds weight i and weight i + 16; Q2_K and Q3_K read BLOCK_K / 4 bytes of
  2-bit quants), dequantizes the low nibbles and the high ones into x's dtype, and multiplies each half by the
  matching columns of x in a tl.dot. So W's bytes are read
  once per BLOCK_M rows: a decode step reads 2.6-8.5 bits per weight where bfloat16 weights take 16. A row's sums
  run in the same order whatever the other rows are, so its result does not depend on its batch.
- `dequantize(w, ids)`: rows of W in its dtype: an embedding lookup, or a slice of W that cuBLAS then multiplies by
  prompt rows (many rows: a dense product is faster than one that dequantizes each tile once per 16 rows).
Floating-point contraction is off: a weight is rounded as the gguf package's dequantization rounds it.

Tested on CPU through Triton's interpreter (TRITON_INTERPRET=1) against the gguf package's dequantization.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.models.packed import PackedWeight

BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 128     # BLOCK_K: a multiple of 32 that divides the K-quants' 256
# GGML's type numbers, as the kernels branch on them
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = (
    tl.constexpr(t) for t in (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23))
# IQ4_NL's 16 values (llama.cpp's kvalues_iq4nl), a byte each, eight to an int64: the first eight + 128, the others
# as they are (positive), so that both constants fit a signed int64
IQ4_NL_LOW, IQ4_NL_HIGH = tl.constexpr(0x766A5D4F3F2D1801), tl.constexpr(0x7159453526190D01)


@triton.jit
def _per(ptr, r, c, mask, stride, WEIGHTS: tl.constexpr):
    """Each weight's value of its block of WEIGHTS weights (a scale or minimum), in float32."""
    return tl.load(ptr + r * stride + c // WEIGHTS, mask=mask, other=0).to(tl.float32)


@triton.jit
def _fifth_bit(q, qh_ptr, r, c, mask, s_qh):
    """q with each weight's fifth bit from qh (byte j: weights 8j..8j+7, bit i of a byte weight 8j + i)."""
    high = tl.load(qh_ptr + r * s_qh + c // 8, mask=mask, other=0).to(tl.int32)
    return q | (((high >> (c % 8)) & 1) << 4)


@triton.jit
def _iq4_value(q):
    """IQ4_NL's and IQ4_XS's value for each 4-bit quant (one of 16)."""
    table = tl.where(q < 8, IQ4_NL_LOW, IQ4_NL_HIGH)
    return ((table >> ((q % 8) * 8).to(tl.int64)) & 255).to(tl.int32) - tl.where(q < 8, 128, 0)


@triton.jit
def _half(q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, rows, start, mask, s_q, s_qh, s_d, s_dmin, s_sub,
          TYPE: tl.constexpr, HIGH: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, k] in float32 for the weights of K-tile `start` that the low nibbles (HIGH 0) or the high ones
    (HIGH 1) hold: j in [0, BLOCK_K / 2), k = start + j // 16 * 32 + 16 * HIGH + j % 16. rows [BLOCK_N] int64."""
    j = tl.arange(0, BLOCK_K // 2)
    r, c = rows[:, None], (start + j // 16 * 32 + 16 * HIGH + j % 16)[None, :]
    if TYPE == Q8_0:
        q = tl.load(q_ptr + r * s_q + c, mask=mask, other=0).to(tl.float32)
        w = q * _per(d_ptr, r, c, mask, s_d, 32)
    elif TYPE == Q2_K or TYPE == Q3_K:      # 2-bit quants: weight 32j + l of 128 in bits 2j of byte l
        two = tl.load(q_ptr + r * s_q + c // 128 * 32 + c % 32, mask=mask, other=0).to(tl.int32)
        q = (two >> (c // 32 % 4 * 2)) & 3
        if TYPE == Q2_K:
            sub = tl.load(sub_ptr + r * s_sub + c // 16, mask=mask, other=0).to(tl.int32)
            w = (_per(d_ptr, r, c, mask, s_d, 256) * (sub & 15).to(tl.float32)) * q.to(tl.float32) \
                - _per(dmin_ptr, r, c, mask, s_dmin, 256) * (sub >> 4).to(tl.float32)
        else:                               # the third bit: weight 32j + l of 256 in bit j of byte l
            high = tl.load(qh_ptr + r * s_qh + c // 256 * 32 + c % 32, mask=mask, other=0).to(tl.int32)
            q = q | (((high >> (c % 256 // 32)) & 1) << 2)
            scale = _per(d_ptr, r, c, mask, s_d, 256) * _per(sub_ptr, r, c, mask, s_sub, 16)
            w = scale * (q - 4).to(tl.float32)
    else:
        nibbles = tl.load(q_ptr + r * s_q + (start // 2 + j)[None, :], mask=mask, other=0).to(tl.int32)
        q = (nibbles >> (4 * HIGH)) & 15
        if TYPE == Q4_0:
            w = (q - 8).to(tl.float32) * _per(d_ptr, r, c, mask, s_d, 32)
        elif TYPE == Q5_0:
            q = _fifth_bit(q, qh_ptr, r, c, mask, s_qh)
            w = (q - 16).to(tl.float32) * _per(d_ptr, r, c, mask, s_d, 32)
        elif TYPE == IQ4_NL:        # q picks one of 16 values
            w = _iq4_value(q).to(tl.float32) * _per(d_ptr, r, c, mask, s_d, 32)
        elif TYPE == IQ4_XS:        # and a scale per 32
            scale = _per(d_ptr, r, c, mask, s_d, 256) * _per(sub_ptr, r, c, mask, s_sub, 32)
            w = scale * _iq4_value(q).to(tl.float32)
        elif TYPE == Q4_1 or TYPE == Q5_1:
            if TYPE == Q5_1:
                q = _fifth_bit(q, qh_ptr, r, c, mask, s_qh)
            w = q.to(tl.float32) * _per(d_ptr, r, c, mask, s_d, 32) + _per(dmin_ptr, r, c, mask, s_dmin, 32)
        elif TYPE == Q6_K:
            high = tl.load(qh_ptr + r * s_qh + c // 4, mask=mask, other=0).to(tl.int32)
            q = q | (((high >> (c % 4 * 2)) & 3) << 4)
            scale = _per(d_ptr, r, c, mask, s_d, 256) * _per(sub_ptr, r, c, mask, s_sub, 16)
            w = scale * (q - 32).to(tl.float32)
        else:               # Q4_K, Q5_K
            if TYPE == Q5_K:
                q = _fifth_bit(q, qh_ptr, r, c, mask, s_qh)
            d, dmin = _per(d_ptr, r, c, mask, s_d, 256), _per(dmin_ptr, r, c, mask, s_dmin, 256)
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
    j = tl.arange(0, BLOCK_K // 2)
    rows, x_rows = n.to(tl.int64), x_ptr + m.to(tl.int64)[:, None] * s_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        low = start + j // 16 * 32 + j % 16           # the low nibbles' columns; the high ones' are 16 further
        in_k = (low < K)[None, :]
        mask = (n < N)[:, None] & in_k
        for half in tl.static_range(2):
            x = tl.load(x_rows + (low + 16 * half)[None, :], mask=(m < M)[:, None] & in_k, other=0.0)
            w = _half(q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, rows, start, mask, s_q, s_qh, s_d, s_dmin, s_sub,
                      TYPE, half, BLOCK_K)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    tl.store(y_ptr + m.to(tl.int64)[:, None] * s_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _dequantize_kernel(ids_ptr, out_ptr, q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, num_ids, K, s_out,
                       s_q, s_qh, s_d, s_dmin, s_sub, TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.program_id(1) * BLOCK_K
    j = tl.arange(0, BLOCK_K // 2)
    rows = tl.load(ids_ptr + i, mask=i < num_ids, other=0).to(tl.int64)
    for half in tl.static_range(2):
        k = start + j // 16 * 32 + 16 * half + j % 16
        mask = (i < num_ids)[:, None] & (k < K)[None, :]
        w = _half(q_ptr, qh_ptr, d_ptr, dmin_ptr, sub_ptr, rows, start, mask, s_q, s_qh, s_d, s_dmin, s_sub, TYPE,
                  half, BLOCK_K)
        tl.store(out_ptr + i.to(tl.int64)[:, None] * s_out + k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def _strides(w: PackedWeight) -> list[int]:
    return [0 if f is None else f.stride(0) for f in w.fields]


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
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32", enable_fp_fusion=False)
    return y


def dequantize(w: PackedWeight, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ids of W, dequantized: [len(ids), in_features] in w.dtype (into out when given)."""
    ids = ids.to(device=w.q.device, dtype=torch.int32).reshape(-1)
    out = torch.empty(len(ids), w.in_features, dtype=w.dtype, device=w.q.device) if out is None else out
    if len(ids):
        grid = (triton.cdiv(len(ids), BLOCK_N), triton.cdiv(w.in_features, BLOCK_K))
        _dequantize_kernel[grid](ids, out, *w.fields, len(ids), w.in_features, out.stride(0), *_strides(w),
                                 TYPE=w.ggml_type, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, enable_fp_fusion=False)
    return out
