"""GGUF blocks rearranged for the Triton kernels that multiply by them on CUDA (triton_quantized.py).

A GGUF row interleaves each block's scales with its quants (18 bytes per 32 weights for Q4_0, 210 per 256 for Q6_K),
and every type orders its 4-bit quants its own way. The kernels want each field in an array of its own and one
order for all, so `pack` splits the blocks once at load, on the device (the file's bytes, plus 4 bytes per 256
weights where Q3_K's, Q4_K's and Q5_K's 6-bit sub-block scales are unpacked to one byte each, 2 for IQ4_XS's):
- q:    int8 [N, K] for Q8_0; Q2_K's and Q3_K's 2 low bits as the file holds them (per 128 weights 32 bytes, byte l
        holding weights l, 32 + l, 64 + l, 96 + l from its low bits up); else the low 4 bits of each quant, 16
        bytes per 32 weights, byte i holding weight i (low nibble) and weight i + 16 (high nibble), as Q4_0 does
- qh:   Q5_0, Q5_1 and Q5_K's fifth bit (byte j: weights 8j..8j+7), Q6_K's two high bits (byte j: weights
        4j..4j+3) or Q3_K's third bit as the file holds it (per 256 weights 32 bytes, byte l bit j: weight 32j + l)
- d:    float16 scale per 32 weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) or per 256 (the K-quants, IQ4_XS)
- dmin: float16 minimum: Q4_1's and Q5_1's per 32, Q2_K, Q4_K and Q5_K's per 256
- sub:  Q4_K and Q5_K's sub-block scale and minimum per 32 (uint8 pairs), Q2_K's per 16 (a byte: scale in its low
        nibble, minimum in its high one, as the file has them), Q3_K's and Q6_K's int8 scale per 16, IQ4_XS's per
        32
A weight is then Q8_0 d·q; Q4_0 d·(q−8); Q5_0 d·(q−16); Q4_1, Q5_1 d·q + dmin; IQ4_NL d·kvalues[q] (16 fixed
values); IQ4_XS (d·sc)·kvalues[q]; Q2_K, Q4_K, Q5_K (d·sc)·q − dmin·m; Q3_K (d·sc)·(q−4); Q6_K (d·sc)·(q−32).
Q5_0, Q5_1 and IQ4_NL are what llama.cpp writes for Q4_K_M's, Q5_K_M's and the lower K-quants' matrices whose rows
are not whole 256-weight blocks (SmolLM2's 576, Qwen2.5-0.5B's 896).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

PACKED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
GROUP = 32      # weights per nibble group of q


@dataclass
class PackedWeight:
    """A weight [out_features, in_features] in pack's layout, on its device; `dtype`: what its products and
    dequantized rows come out in."""
    ggml_type: int
    in_features: int
    dtype: torch.dtype
    q: torch.Tensor
    qh: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None
    sub: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def type_name(self) -> str:
        return T(self.ggml_type).name

    @property
    def fields(self) -> tuple[torch.Tensor | None, ...]:
        """Every field, None where the type has none: the kernels' arguments."""
        return self.q, self.qh, self.d, self.dmin, self.sub

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.fields if f is not None)

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        from kvtier.models import triton_quantized
        return triton_quantized.dequantize(self, ids, out)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        from kvtier.models import triton_quantized
        return triton_quantized.product(x, self)


def packable(ggml_type: int) -> bool:
    return ggml_type in PACKED_TYPES


# bytes per 256 weights that packing adds: sub-block scales unpacked to a byte each (IQ4_XS's 8 from 6)
_UNPACKED_SCALES = {T.Q4_K: 4, T.Q5_K: 4, T.Q3_K: 4, T.IQ4_XS: 2}


def packed_bytes(ggml_type: int, nbytes: int) -> int:
    """What GGUF blocks of nbytes take packed: the file's bytes, plus what unpacking sub-block scales adds."""
    kind = T(ggml_type)
    type_size = GGML_QUANT_SIZES[kind][1]
    return nbytes // type_size * (type_size + _UNPACKED_SCALES.get(kind, 0))


def pack(blocks: torch.Tensor, ggml_type: int, in_features: int, device: torch.device,
         dtype: torch.dtype) -> PackedWeight:
    """GGUF blocks (uint8 [out_features, bytes per row]) in pack's layout on device."""
    kind = T(ggml_type)
    if kind not in PACKED_TYPES:
        raise ValueError(f"no kernel multiplies {kind.name} weights on {device}")
    block_size, type_size = GGML_QUANT_SIZES[kind]
    n = blocks.shape[0]
    b = blocks.to(device).view(n, in_features // block_size, type_size)
    half = lambda at: b[..., at:at + 2].contiguous().view(torch.float16).reshape(n, -1)     # noqa: E731
    if kind == T.Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).reshape(n, in_features)
        return PackedWeight(ggml_type, in_features, dtype, q, None, half(0), None, None)
    if kind in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL):     # d (and a minimum), Q5's 32 fifth bits, nibbles
        at = 2 if kind in (T.Q4_0, T.Q5_0, T.IQ4_NL) else 4
        qh, at = (b[..., at:at + 4].reshape(n, in_features // 8).contiguous(), at + 4) if kind in (T.Q5_0, T.Q5_1) \
            else (None, at)
        q = b[..., at:].reshape(n, in_features // 2).contiguous()
        return PackedWeight(ggml_type, in_features, dtype, q, qh, half(0),
                            half(2) if kind in (T.Q4_1, T.Q5_1) else None, None)
    if kind in (T.Q2_K, T.Q3_K):     # the 2-bit quants (and Q3_K's third bits) stay as the file has them
        if kind == T.Q2_K:
            return PackedWeight(ggml_type, in_features, dtype, b[..., 16:80].reshape(n, -1).contiguous(), None,
                                half(80), half(82), b[..., :16].reshape(n, -1).contiguous())
        return PackedWeight(ggml_type, in_features, dtype, b[..., 32:96].reshape(n, -1).contiguous(),
                            b[..., :32].reshape(n, -1).contiguous(), half(108), None, _q3_k_scales(b[..., 96:108]))
    if kind == T.IQ4_XS:             # d, 2 high bits of each 6-bit scale, their 4 low bits, nibbles as Q4_0's
        low = torch.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], -1).reshape(n, -1, 8)
        high = (b[..., 2:4].contiguous().view(torch.int16).to(torch.int32) >> torch.arange(0, 16, 2, device=device)) & 3
        scales = (low.to(torch.int32) | (high << 4)) - 32
        return PackedWeight(ggml_type, in_features, dtype, b[..., 8:].reshape(n, -1).contiguous(), None, half(0),
                            None, scales.to(torch.int8).reshape(n, -1))
    if kind == T.Q6_K:
        quants = _q6_k(b[..., :192])
        hi = (quants >> 4).view(n, -1, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device)
        scales = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
        return PackedWeight(ggml_type, in_features, dtype, _nibbles(quants), hi.sum(-1, dtype=torch.uint8),
                            half(208), None, scales)
    scales = b[..., 4:16]
    s0, s1, s2 = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([s0 & 63, (s2 & 15) | ((s0 >> 6) << 4)], -1)        # llama.cpp's get_scale_min_k4
    mins = torch.cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], -1)
    sub = torch.stack([sc, mins], -1).reshape(n, -1)
    quants, qh = _k_quants(b[..., 16:] if kind == T.Q4_K else b[..., 48:]), None
    if kind == T.Q5_K:     # bit 2c of qh[l] tops weight 64c + l, bit 2c + 1 weight 64c + 32 + l
        shifts = torch.arange(8, dtype=torch.uint8, device=device).view(4, 2, 1)
        quants = quants | ((((b[..., 16:48].unsqueeze(-2).unsqueeze(-2) >> shifts) & 1) << 4).reshape(n, -1))
        bits = (quants >> 4).view(n, -1, 8) << torch.arange(8, dtype=torch.uint8, device=device)
        qh = bits.sum(-1, dtype=torch.uint8)
    return PackedWeight(ggml_type, in_features, dtype, _nibbles(quants), qh, half(0), half(2), sub.contiguous())


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """Q3_K's 16 6-bit scales per 256 weights, less 32, as int8 [N, K / 16]: scale i's low 4 bits are byte i % 8's
    nibble i // 8, its high 2 bits byte 8 + i % 4's bits 2 (i // 4) (llama.cpp's dequantize_row_q3_K)."""
    n, i = scales.shape[0], torch.arange(16, device=scales.device)
    low = (scales[..., i % 8].to(torch.int32) >> (4 * (i // 8))) & 15
    high = (scales[..., 8 + i % 4].to(torch.int32) >> (2 * (i // 4))) & 3
    return ((low | (high << 4)) - 32).to(torch.int8).reshape(n, -1)


def _k_quants(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K and Q5_K's 4 low bits in weight order: per 64 weights 32 bytes, low nibbles first, then high ones."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 4, 1, 32)
    return torch.cat([qs & 15, qs >> 4], -2).reshape(n, -1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit quants in weight order: per 128 weights, ql's 64 bytes give the low nibbles of 32j + l (j = 0:
    low nibble of byte l, 1: of byte 32 + l, 2 and 3 their high nibbles) and qh's 32 bytes the top two bits (bits
    2j, 2j + 1 of byte l)."""
    n = b.shape[0]
    ql = b[..., :128].reshape(n, -1, 2, 2, 32)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], -2)                                          # [n, blocks, 2, 4, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    return (low | (((qh >> shifts) & 3) << 4)).reshape(n, -1)


def _nibbles(quants: torch.Tensor) -> torch.Tensor:
    """Quants [N, K] (their low 4 bits) as q's nibble pairs [N, K / 2]."""
    low = (quants & 15).view(quants.shape[0], -1, 2, GROUP // 2)
    return (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(quants.shape[0], -1)
