"""A decoder layer's elementwise work on CUDA, one Triton kernel each where eager torch launches several: RMSNorm
(four kernels in half precision: to float32, normalize, back, weight), RoPE (five: two products, a negation, a cat and
a sum) and SiLU(gate) * up (two): 11 of the ~19 small launches a layer that took 1.07 ms of a batch-1 decode step's
4.1 ms of GPU time in the Llama-3.1-8B shape on an H200 (docs/BENCHMARKS.md, the GPU check of 2026-11-28).

Each rounds where the eager ops round (RMSNorm normalizes in float32, rounds, then weighs; RoPE rounds each product,
then their sum; SiLU's output is rounded before the product), so half-precision results stay within a rounding of
theirs. Every row is computed by programs of its own, alike whatever rows stand beside it.

Tested on CPU through Triton's interpreter (TRITON_INTERPRET=1) against the eager ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024     # columns of SiLU(gate) * up per program


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, s_x, s_out, eps, BLOCK: tl.constexpr,
                     ROUND_BEFORE_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    if ROUND_BEFORE_WEIGHT:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension: in float32, and in half precision rounded before the weight, as
    `decoder.RMSNorm` does eagerly."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if len(rows):
        _rms_norm_kernel[(len(rows),)](rows, weight, out, rows.shape[1], rows.stride(0), out.stride(0), eps,
                                       BLOCK=triton.next_power_of_2(rows.shape[1]),
                                       ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
                                       num_warps=_warps(rows.shape[1]))
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, s_xt, s_xh, s_ct, HALF: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HALF)
    src = x_ptr + t * s_xt + h * s_xh + d
    x1 = tl.load(src, mask=mask, other=0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0).to(tl.float32)
    table = t * s_ct + d
    cos1 = tl.load(cos_ptr + table, mask=d < HALF, other=0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=d < HALF, other=0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=d < HALF, other=0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=d < HALF, other=0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # x * cos + cat([-x2, x1]) * sin, each product rounded to the output's dtype, then their sum
    first = (x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)
    second = (x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)
    dst = out_ptr + (t * heads + h) * (2 * HALF) + d
    tl.store(dst, first.to(dt), mask=mask)
    tl.store(dst + HALF, second.to(dt), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any strides) rotated in the rotate_half layout by cos and sin [T, 1, D] in x's dtype (as
    `decoder.apply_rope` is given them), into a new contiguous tensor."""
    t, heads, dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    cos, sin = (table.reshape(t, dim).contiguous() for table in (cos, sin))
    if t:
        block_h = min(triton.next_power_of_2(heads), 16)
        _rope_kernel[(t, triton.cdiv(heads, block_h))](x, cos, sin, out, heads, x.stride(0), x.stride(1),
                                                       cos.stride(0), HALF=dim // 2,
                                                       BLOCK_D=triton.next_power_of_2(dim // 2), BLOCK_H=block_h,
                                                       enable_fp_fusion=False)    # a product and a sum, as eager
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, s_x, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + n_cols + cols, mask=mask, other=0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    silu = (gate / (1 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, (silu * up).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2 * I] (gate first, as `decoder.MLP` splits it): [T, I]."""
    t, width = gate_up.shape
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((t, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(width // 2, SILU_BLOCK))](gate_up, out, width // 2, gate_up.stride(0),
                                                                   out.stride(0), BLOCK=SILU_BLOCK)
    return out


def _warps(cols: int) -> int:
    """Warps for a program that reduces a row of cols: more for wide rows (a 4096-wide hidden state: 8)."""
    return max(1, min(16, triton.next_power_of_2(cols) // 512))
