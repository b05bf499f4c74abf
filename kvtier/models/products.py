"""The decoder's CPU products of float weights: one row padded to two, and oneDNN's product (else MKL's) for more
rows; and the dtype in which quantized weights' prompt rows multiply."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("kvtier.models")


# On CPU, a product of up to this many rows (a decode step of a few sequences) takes the weight as BLAS's tall left
# matrix, one row padded to two. MKL's matrix-vector product (one row) reads the weight at about 10 GB/s where its
# two-column product reads it at about 29 GB/s, near the memory's read bandwidth: one row through SmolLM2's 30 layers
# takes 35 ms as F.linear and 15 ms padded to two, 2-4 rows about 2x less than F.linear (2-core EPYC, weights out of
# cache). More rows take many_rows_product: from 5 rows oneDNN's product is faster still, where it is chosen (SmolLM2's
# MLP weights at 5 rows: 12.1-12.3 ms against 15.5-17.0 ms through BLAS; at 4 rows 11.8 against 9.4-10.4).
FEW_ROWS = 4


class Linear(nn.Linear):
    """nn.Linear, with the CPU products for a few rows (above) and for more (many_rows_product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type != "cpu" or rows == 0:
            return F.linear(x, self.weight, self.bias)
        if rows > FEW_ROWS:
            return many_rows_product(x.dtype)(x, self.weight, self.bias)
        padded = F.pad(x, (0, 0, 0, 1)) if rows == 1 else x
        return _weight_on_the_left(padded, self.weight, self.bias)[:rows]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product (the one torch.compile uses on CPU), where F.linear takes MKL's."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@functools.cache
def many_rows_product(dtype: torch.dtype):
    """oneDNN's product on CPU for more than FEW_ROWS rows (decode batches, prompt chunks), F.linear where this build
    of torch has none for the dtype or it disagrees. Chosen by the build, not by a timing: the two round otherwise
    (~1e-4 apart on a chunk of SmolLM2's rows), and a choice that flipped from one start to the next with the
    machine's load would restore K/V computed otherwise than a cold prompt computes it now (warm equals cold,
    DESIGN.md). On a 2-core EPYC oneDNN's is 1.2-1.4x faster (MKL takes a slower path on AMD CPUs): prefill of the
    bundled model 9-12% faster at 2K-4K tokens, the 58-token turn after a cached 4K history 13% (A/B, alternating).
    Not measured on Intel CPUs, where MKL may be the faster: a choice by CPU vendor would have to be measured first."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=generator).to(dtype)
    weight = torch.randn(2048, 1024, generator=generator).to(dtype)
    try:
        agrees = torch.allclose(onednn_linear(x, weight, None).float(), F.linear(x, weight).float(), rtol=1e-2,
                                atol=0.25)
    except (RuntimeError, AttributeError):
        agrees = False
    chosen = onednn_linear if agrees else F.linear
    log.info("CPU products of many %s rows: %s", dtype, chosen.__name__)
    return _in_row_blocks(chosen, ROW_BLOCK)


# Rows a product of many takes at once: padded to whole blocks of this many. oneDNN's product of a row count just
# short of a block boundary can take a slower path: SmolLM2's 3072x576 weight (2-core EPYC, medians) at 511 rows
# 18.8-34.9 ms against 14.8-17.6 at 512, at 1023 34.3-37.5 against 30.9-32.4, at 2047 67-76 against 55-63 (padded to
# 2048); other counts about even. A chunk ending a prompt whose last token runs alone after it has such counts.
ROW_BLOCK = 16


def _in_row_blocks(product, block: int):
    """product, its rows padded with zeros to whole blocks of `block` rows (a padding row changes no other row's
    product)."""
    @functools.wraps(product)
    def padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        pad = -len(x) % block
        return product(F.pad(x, (0, 0, 0, pad)), weight, bias)[:len(x)] if pad else product(x, weight, bias)
    return padded


# Prompt rows multiplying a weight slice just dequantized (quantized.py), in cache: up to this many float32 rows,
# padded with zeros to a whole number of MKL's blocks of 16 columns, take it as BLAS's tall left matrix, where
# oneDNN's product of a few rows is slower (MKL takes a slower path at other row counts: at 15 rows oneDNN's was 1.3x
# faster, 2.5-2.7x on a weight already in cache). SmolLM2's four projections (2-core EPYC, each slice written just
# before): the left matrix at 16 rows 1.5-1.9x oneDNN's speed, at 32 1.1-1.3x, at 64 1.3-2.7x; the whole model's
# projections at 48 and 64 rows 1.26-1.36x; at 128 and 256 even, at 512 and 2048 oneDNN's ahead in the largest
# (3072x576: 1.2x). A turn of 64 new tokens after a cached 1024-token prefix, whose chunk has 63 rows (its last token
# runs in the decode graph), came 1.12x sooner padded to 64 than through oneDNN (519 against 581 ms), 32 tokens 1.07x,
# 16 even (alternating in one process, medians of 6).
SHORT_CHUNK = 64
MKL_BLOCK = 16


def cached_weight_product(dtype: torch.dtype, rows: int):
    """The product of `rows` rows with a weight slice in cache: BLAS's, the weight on the left, for a short chunk
    of float32 rows padded to whole MKL blocks (SHORT_CHUNK, MKL_BLOCK), else many_rows_product. Chosen by the rows,
    never by a timing, as Linear's are: the rows of the forward's prompt product, so a chunk beside another prompt's
    may take the other kernel, whose sums round otherwise (float32's rounding, as oneDNN's own blocking by rows
    already does)."""
    if dtype != torch.float32 or rows > SHORT_CHUNK:
        return many_rows_product(dtype)
    return _left_in_blocks


def _weight_on_the_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = (weight @ x.T).T.contiguous()
    return y if bias is None else y + bias


_left_in_blocks = _in_row_blocks(_weight_on_the_left, MKL_BLOCK)


@functools.cache
def dequantized_dtype() -> torch.dtype:
    """The dtype in which prompt rows multiply by a quantized weight dequantized on CPU (quantized.py): bfloat16
    where the CPU has bfloat16 dot products (AVX512-BF16, AMX), which oneDNN's product uses, else float32. Chosen by
    the CPU, not by a timing, so that the K/V a prompt computes is the same from one start to the next (the weights'
    fingerprint names it). On a 2-core EPYC with AVX512-BF16 SmolLM2's Q4_1 projections at 512 rows take 1.5-1.7x
    less time in bfloat16, dequantization included. Its rounding (at most 2^-8 of a value) is well below a 4-bit
    block's own (2^-5 of the block's range) and about that of Q8_0's blocks and of the decode rows' 8-bit
    activations."""
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    native = capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")
    return torch.bfloat16 if native and torch.backends.mkldnn.is_available() else torch.float32
