"""Q4_0 and Q4_1 weights in ggml's interleaved CPU_REPACK layout, where decode rows multiply faster.

ggml multiplies a weight whose rows it has interleaved eight at a time (`block_q4_0x8`: eight rows' scales, then
their quants in 8-byte turns) by up to four activation rows at once, unpacking each block once for all of them:
1.3-1.45x as fast as the file's layout at one row, 1.6-2x at eight (`kvtier bench kernels`). Its one-row and
multi-row kernels round a row alike, so a row's logits still do not depend on what else is in its step; Q4_K's
repacked kernels do not (a row rounds by its batch), so Q4_K keeps the file's layout, as do the types ggml has no
layout for on this CPU (Q8_0, Q6_K with AVX2).

ggml has no such layout for Q4_1, whose product over the file's blocks is its slowest (5-6x one row's time at eight
rows): a Q4_1 weight is kept as Q4_0 blocks plus each block's offset. Q4_1's value d*q + m is Q4_0's d*(q - 8) plus
m + 8d, so its product with x is the interleaved Q4_0 product plus, per output, each block's offset times the sum
of x over the block's 32 inputs (`offsets`, float32: m + 8d of two float16s is exact in it, and the file's m comes
back from it). The offsets add 4 bytes to each 18-byte block (Q4_1's take 20); the decode graph of the bundled
model's projections alone ran 1.1x as fast at one row, 1.6-1.8x at four and eight (one run, 2-core EPYC).

The repacked copy is the weight's only one, so weights take about the file's memory: prompt rows, which dequantize
the weight for torch's product, get its rows back in the file's layout (`plain`) for the slice they dequantize. At
load a weight is repacked only where that round trip gives back its blocks and (once per process) where the
repacked product rounds a row alike alone and among others; else it keeps the file's layout.
"""
from __future__ import annotations

import functools
import weakref

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvtier.models import ggml
from kvtier.models.quantized import GgmlWeight, QuantizedWeight

GROUP_ROWS = 8                                      # rows ggml interleaves
Q4_0, Q4_1 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
BLOCK = GGML_QUANT_SIZES[Q4_0][0]                   # weights per block (Q4_1's alike)
_SCALE_BYTES, _QUANT_BYTES = 2, 16                  # a Q4_0 block: float16 scale, 32 4-bit quants (Q4_1: scale, min,
                                                    # quants)
_TURN = 8                                           # bytes of a row's quants per turn in an interleaved block
# ggml flips each 4-bit quant's high bit when it interleaves: 0x88 in every byte of an int64 turn
_FLIPPED = torch.tensor(int.from_bytes(b"\x88" * 8, "little", signed=True), dtype=torch.int64)


class RepackedWeight(GgmlWeight):
    """A Q4_0 or Q4_1 weight [out_features, in_features] in ggml's memory as interleaved Q4_0 blocks, and a Q4_1
    weight's offsets: float32 [blocks per row, out_features] (module doc)."""

    def __init__(self, ctx: ggml.Context, tensor: int, ggml_type: int, in_features: int, out_features: int,
                 offsets: torch.Tensor | None = None):
        self.ctx, self.tensor = ctx, tensor
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, out_features
        # [groups of 8 rows, blocks per row, 8 scales then 8 rows' quants]
        self.groups = ggml.memory(tensor).view(out_features // GROUP_ROWS, in_features // BLOCK,
                                               GROUP_ROWS * (_SCALE_BYTES + _QUANT_BYTES))
        self.offsets = offsets
        self.offsets_tensor = None if offsets is None else ctx.place(offsets)
        weakref.finalize(self, ctx.close)

    @property
    def nbytes(self) -> int:
        return self.groups.numel() + (0 if self.offsets is None else self.offsets.numel() * 4)

    def placed(self, ctx: ggml.Context) -> int:
        """The weight's ggml tensor, for ctx's ops (it lives in its own context, kept as long as ctx)."""
        ctx.hold(self)
        return self.tensor

    def multiplied(self, ctx: ggml.Context, weight: int, x: int) -> int:
        """The interleaved product, plus for Q4_1 each block's offset times the sum of x over the block (module
        doc): per output one multiply-add per block, over the outputs at once (ggml's out_prod takes the sums as
        [rows, blocks]). x must be contiguous."""
        y = ctx.op("mul_mat", weight, x)
        if self.offsets is None:
            return y
        blocks, rows = self.in_features // BLOCK, ggml.shape(x)[0][1]
        sums = ctx.op("sum_rows", ctx.op("reshape_3d", x, BLOCK, blocks, rows))        # [1, blocks, rows]
        sums = ctx.op("reshape_2d", sums, 1, blocks) if rows == 1 else \
            ctx.op("cont", ctx.op("permute", ctx.op("reshape_2d", sums, blocks, rows), 1, 0, 2, 3))
        return ctx.op("add", y, ctx.op("out_prod", self.offsets_tensor, sums))

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
        """Rows of the weight, dequantized (QuantizedWeight.rows) from the groups that hold them, put back in the
        file's layout."""
        ids = ids.long()
        groups, local = torch.unique(ids // GROUP_ROWS, return_inverse=True)
        plain = QuantizedWeight(self.plain(groups), self.ggml_type, self.in_features)
        return plain.rows(local * GROUP_ROWS + ids % GROUP_ROWS, out, threads)

    def plain(self, groups: torch.Tensor) -> torch.Tensor:
        """The blocks of the given groups' rows (ascending) in the file's layout: uint8 [8 * len(groups), bytes per
        row], valid until the next call (its memory is reused: fresh memory would cost its page faults each
        prompt). A group's interleaved block is 8 scales, then 16 turns of 8 quant bytes, turn t row t % 8's bytes
        8 * (t // 8) onwards: the turns move as int64s, the flipped bits flipped back in the same pass, then into
        their blocks (as int16s; Q4_1's as int32s, after its scale and min: its offset less 8 scales)."""
        first, last = groups[0].item(), groups[-1].item()
        whole = last - first + 1 == len(groups)
        g = self.groups[first:last + 1] if whole else self.groups[groups]
        n, blocks = g.shape[:2]
        turns_per_row = _QUANT_BYTES // _TURN
        turns = g.view(torch.int64)[..., GROUP_ROWS * _SCALE_BYTES // 8:].view(n, blocks, turns_per_row, GROUP_ROWS)
        rows = _scratch("turns", n * GROUP_ROWS * blocks * _QUANT_BYTES).view(torch.int64).view(
            n, GROUP_ROWS, blocks, turns_per_row)
        torch.bitwise_xor(turns.permute(0, 3, 1, 2), _FLIPPED, out=rows)
        scales = g.view(torch.int16)[..., :GROUP_ROWS].transpose(1, 2)
        if self.offsets is None:
            out = _scratch("blocks", n * GROUP_ROWS * blocks * (_SCALE_BYTES + _QUANT_BYTES)).view(torch.int16).view(
                n, GROUP_ROWS, blocks, (_SCALE_BYTES + _QUANT_BYTES) // 2)
            out[..., 0] = scales
            out[..., 1:] = rows.view(torch.int16)
            return out.view(torch.uint8).view(n * GROUP_ROWS, -1)
        out = _scratch("blocks", n * GROUP_ROWS * blocks * (2 * _SCALE_BYTES + _QUANT_BYTES)).view(torch.int32).view(
            n, GROUP_ROWS, blocks, (2 * _SCALE_BYTES + _QUANT_BYTES) // 4)
        offsets = self.offsets[:, first * GROUP_ROWS:(last + 1) * GROUP_ROWS] if whole else \
            self.offsets[:, (groups[:, None] * GROUP_ROWS + torch.arange(GROUP_ROWS)).flatten()]
        mins = (offsets.t().reshape(n, GROUP_ROWS, blocks) - 8 * scales.view(torch.float16).float()).half()
        scale_and_min = out.view(torch.int16).view(n, GROUP_ROWS, blocks, -1)[..., :2]
        scale_and_min[..., 0] = scales
        scale_and_min[..., 1] = mins.view(torch.int16)
        out[..., 1:] = rows.view(torch.int32)
        return out.view(torch.uint8).view(n * GROUP_ROWS, -1)


_SCRATCH: dict[str, torch.Tensor] = {}     # memory `plain` reuses, by name


def _scratch(name: str, nbytes: int) -> torch.Tensor:
    """nbytes of the memory kept under `name` (grown when too small): a normal tensor, which torch writes in place
    in inference mode and out of it alike."""
    if name not in _SCRATCH or _SCRATCH[name].numel() < nbytes:
        with torch.inference_mode(False):
            _SCRATCH[name] = torch.empty(nbytes, dtype=torch.uint8)
    return _SCRATCH[name][:nbytes]


def repacked(weight: QuantizedWeight) -> QuantizedWeight | RepackedWeight:
    """The weight in ggml's interleaved layout where it is Q4_0 or Q4_1 and that rounds rows alike (module doc);
    else itself."""
    threads = torch.get_num_threads()
    if weight.ggml_type not in (Q4_0, Q4_1) or weight.out_features % GROUP_ROWS or not _rounds_rows_alike(threads):
        return weight
    packed = _interleaved(weight, threads)
    ends = torch.tensor([0, weight.out_features // GROUP_ROWS - 1])
    # another interleaving than block_q4_0x8's (another ggml, another CPU) would not come back as the file's blocks
    if packed is None or not torch.equal(packed.plain(ends), weight.blocks.view(-1, GROUP_ROWS, weight.blocks.shape[1])
                                         [ends].flatten(0, 1)):
        return weight
    return packed


def _interleaved(weight: QuantizedWeight, threads: int) -> RepackedWeight | None:
    """The weight copied into ggml's CPU_REPACK memory; None where ggml has no layout for it here (or a Q4_1
    weight's mins would not come back from its offsets)."""
    blocks, offsets = (weight.blocks, None) if weight.ggml_type == Q4_0 else _as_q4_0(weight.blocks)
    if blocks is None:
        return None
    ctx = ggml.Context(threads, max_tensors=2)
    tensor = ctx.place_repacked(blocks, Q4_0, (weight.in_features, weight.out_features))
    if tensor is None:
        ctx.close()
        return None
    return RepackedWeight(ctx, tensor, weight.ggml_type, weight.in_features, weight.out_features, offsets)


def _as_q4_0(q4_1: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Q4_1 blocks (uint8 [rows, bytes per row]) as Q4_0 blocks of the same scales and quants and each block's
    offset m + 8d (float32 [blocks per row, rows]); (None, None) where an m would not come back from its offset."""
    rows = q4_1.shape[0]
    q4_1 = q4_1.view(rows, -1, 2 * _SCALE_BYTES + _QUANT_BYTES)
    offsets = torch.empty(q4_1.shape[1], rows)      # kept: made before the temporaries, which leave no hole below it
    eight_scales = q4_1[..., :_SCALE_BYTES].contiguous().view(torch.float16)[..., 0].t().float().mul_(8)
    mins = q4_1[..., _SCALE_BYTES:2 * _SCALE_BYTES].contiguous().view(torch.float16)[..., 0].t()
    torch.add(mins, eight_scales, out=offsets)
    if not torch.equal(offsets.sub(eight_scales).half().view(torch.int16), mins.view(torch.int16)):
        return None, None
    q4_0 = torch.cat([q4_1[..., :_SCALE_BYTES], q4_1[..., 2 * _SCALE_BYTES:]], -1).view(rows, -1)
    return q4_0, offsets


@functools.cache
def _rounds_rows_alike(threads: int) -> bool:
    """Whether ggml's repacked Q4_0 product gives each of 5 rows (its multi-row kernel takes 4 at a time, the fifth
    alone) bitwise what that row gives alone."""
    generator = torch.Generator().manual_seed(0)
    packed = _interleaved(QuantizedWeight(ggml.quantize(torch.randn(64, 256, generator=generator), Q4_0), Q4_0, 256),
                          threads)
    if packed is None:
        return False
    x = torch.randn(5, 256, generator=generator)
    together = packed.product(x)
    return all(torch.equal(packed.product(x[i:i + 1])[0], together[i]) for i in range(len(x)))
