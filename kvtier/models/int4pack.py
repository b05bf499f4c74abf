"""Q4_0 and Q4_1 projections on CUDA in torch's own int4 layout, multiplied by its tinygemm kernel
(`torch.ops.aten._weight_int4pack_mm`) for decode rows; prompt rows go to cuBLAS over rows dequantized from the same
layout (triton_int4pack.py), as for packed.py's weights (tinygemm's tiles serve a few rows: on the H100, prefill of
the Llama-3.1-8B shape through it ran at 0.06x its speed in bfloat16).

On an H100 (`kvtier bench kernels`, 2026-11-27) tinygemm read a 4096x14336 int4 weight at 1199 GB/s for one row and
a 4096x4096 one at 596 GB/s, where kvtier's Triton kernel over packed.py's layout read Q4_0 at 128-139 GB/s: decode
of the Llama-3.1-8B shape in Q4_0 ran at 0.27x its speed in bfloat16. tinygemm's weight is (q - 8) * scale + zero per
group of 32 weights along K, scale and zero in bfloat16, so both types convert without requantizing: Q4_0's
d * (q - 8) is scale d, zero 0; Q4_1's d * q + m is scale d, zero m + 8d (the float16 scales rounded to bfloat16:
2^-9 of a scale). An embedding keeps packed.py's layout.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from kvtier.models.choice import fastest
from kvtier.models.packed import GROUP, PackedWeight

INNER_K_TILES = 8      # tinygemm's K tiles per pack: K must be a multiple of 16 of them
TINYGEMM_TYPES = (T.Q4_0, T.Q4_1)     # the block types that convert to its layout without requantizing
TINYGEMM = 0           # an Int4PackWeight's splits when tinygemm multiplies its decode rows
CHOICE_ROWS = (1, 16, 64)   # the row counts decode products are chosen by: batch 1, a bucket of 16, a verify step

log = logging.getLogger("kvtier.models")


@dataclass
class Int4PackWeight:
    """A weight [out_features, in_features] in tinygemm's layout; products come out in bfloat16."""
    ggml_type: int
    in_features: int
    out_features: int
    packed: torch.Tensor              # int32, _convert_weight_to_int4pack's
    scales_and_zeros: torch.Tensor    # bfloat16 [in_features / 32, out_features, 2]
    splits: int = TINYGEMM            # decode rows' product: tinygemm's, else the split-K Triton product's in this
                                      # many parts of K (choose_decode_products)

    @property
    def type_name(self) -> str:
        return T(self.ggml_type).name

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ids, dequantized in bfloat16 (into out when given)."""
        from kvtier.models import triton_int4pack
        if out is None:
            out = torch.empty(ids.numel(), self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return triton_int4pack.dequantize(self.packed, self.scales_and_zeros, GROUP, ids, out)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.product_with(x, self.splits)

    def product_with(self, x: torch.Tensor, splits: int) -> torch.Tensor:
        """x [M, K] by the weight, by tinygemm (splits TINYGEMM) or the split-K Triton product."""
        if splits != TINYGEMM:
            from kvtier.models import triton_int4pack
            return triton_int4pack.product(self.packed, self.scales_and_zeros, GROUP, x, splits)
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.packed, GROUP, self.scales_and_zeros)


def takes(weight: PackedWeight) -> bool:
    """Whether tinygemm multiplies this weight: Q4_0 or Q4_1 on CUDA in bfloat16, of shapes its tiles divide."""
    return (weight.q.device.type == "cuda" and weight.dtype == torch.bfloat16
            and T(weight.ggml_type) in TINYGEMM_TYPES and weight.in_features % (INNER_K_TILES * 16) == 0
            and weight.out_features % 8 == 0)


def quants_scales_zeros(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 or Q4_1 weight as tinygemm's terms: its quants in weight order (uint8 [N, K], 0-15) and per group of 32
    a scale and a zero (float32 [N, K / 32]), such that weight = (q - 8) * scale + zero."""
    n, k = weight.out_features, weight.in_features
    nibbles = weight.q.view(n, k // GROUP, GROUP // 2)          # byte i: weight i (low nibble), i + 16 (high)
    quants = torch.cat([nibbles & 15, nibbles >> 4], -1).reshape(n, k)
    scale = weight.d.float()
    offset = -8 * scale if weight.dmin is None else weight.dmin.float()     # Q4_0's d·(q−8), Q4_1's d·q + m
    return quants, scale, offset + 8 * scale


def int4packed(weight: PackedWeight) -> PackedWeight | Int4PackWeight:
    """The weight in tinygemm's layout where `takes` it, else as it is."""
    if not takes(weight):
        return weight
    quants, scale, zero = quants_scales_zeros(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack(quants[:, ::2] << 4 | quants[:, 1::2], INNER_K_TILES)
    scales_and_zeros = torch.stack([scale, zero], -1).to(torch.bfloat16).transpose(0, 1).contiguous()
    return Int4PackWeight(weight.ggml_type, weight.in_features, weight.out_features, packed, scales_and_zeros)


def choose_decode_products(weights: list[Int4PackWeight]) -> dict[tuple[int, int], tuple[str, dict[str, float]]]:
    """Per shape, the product its decode rows take: tinygemm's or the split-K Triton product, whichever multiplies
    CHOICE_ROWS rows by every weight of the shape faster on this device with tinygemm's result (`choice.fastest`, in
    CUDA graphs as decode steps run; on an H100 tinygemm read a 4096x4096 weight at 596 GB/s for one row, a fifth of
    the card's bandwidth). One product for all of a weight's decode rows, so a row rounds alike in every batch.
    Returns each shape's choice and the seconds per product each candidate measured (summed over the row counts),
    as logged."""
    from kvtier.models import triton_int4pack
    by_shape = defaultdict(list)
    for weight in weights:
        by_shape[weight.out_features, weight.in_features].append(weight)
    choices = {}
    for (n, k), group in by_shape.items():
        if not triton_int4pack.takes(n, k):
            continue
        device = group[0].packed.device
        options = {"tinygemm": TINYGEMM, "split-K Triton": triton_int4pack.decode_splits(n, k, device)}
        chosen, seconds = fastest({name: lambda w, x, splits=splits: w.product_with(x, splits)
                                   for name, splits in options.items()},
                                  group, k, CHOICE_ROWS, torch.bfloat16, device)
        for weight in group:
            weight.splits = options[chosen]
        choices[n, k] = chosen, seconds
        log.info("int4 decode products: %s", described(n, k, chosen, seconds))
    return choices


def described(n: int, k: int, chosen: str, seconds: dict[str, float]) -> str:
    """One shape's choice of decode product, with what each candidate measured (the log's and the benchmark's)."""
    times = ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in seconds.items())
    return f"{k}x{n} decode rows by {chosen} ({times} for {', '.join(map(str, CHOICE_ROWS))} rows)"
