"""Q4_0 weights, and Q4_1 ones as Q4_0 plus a shift per block, in ggml's interleaved CPU_REPACK layout, where decode
rows multiply faster.

ggml multiplies a weight whose rows it has interleaved eight at a time (`block_q4_0x8`: eight rows' scales, then
their quants in 8-byte turns) by up to four activation rows at once, unpacking each block once for all of them:
1.3-1.45x as fast as the file's layout at one row, 1.6-2x at eight (`kvtier bench kernels`). Its one-row and
multi-row kernels round a row alike, so a row's logits still do not depend on what else is in its step; Q4_K's
repacked kernels do not (a row rounds by its batch), so Q4_K keeps the file's layout, as do the types ggml has no
layout for on this CPU (Q8_0, Q6_K with AVX2).

Q4_1 has no such layout, and its product over the file's blocks (vec_dot_q4_1_q8_1, a row at a time) bounded the
bundled model's decode. But Q4_1's weight d·q + m is Q4_0's d·(q − 8) with the same scale and quants, plus 8d + m:
`ShiftedWeight` keeps those Q4_0 blocks interleaved and the shifts in float32 (4 bytes per 32 weights: 1.1x the
file's bytes), and its product is the Q4_0 one plus the shifts times x's sums per block of 32, which ggml takes in
float32 (`ggml.block_sums_product`): the bundled model's four projections took 0.76x the time at one row and 0.57x
at nine. The shifts' part adds x exactly where Q4_1's kernel adds the block sums of x rounded to 8 bits, in
float16.

The repacked copy is the weight's only one, so weights take the file's memory (Q4_1 1.1x it, with its shifts):
prompt rows, which dequantize the weight for torch's product, get its rows back in the file's layout (`plain`) for
the slice they dequantize. At load a weight is repacked only where that round trip gives back its blocks and (once
per process) where the repacked product rounds a row alike alone and among others; else it keeps the file's
layout.
"""
from __future__ import annotations

import functools
import weakref

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvtier.models import ggml
from kvtier.models.quantized import DEQUANTIZING, GgmlWeight, Placed, QuantizedWeight

GROUP_ROWS = 8                                      # rows ggml interleaves
Q4_0, Q4_1 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
_SCALE_BYTES, _QUANT_BYTES = 2, 16                  # a Q4_0 block: float16 scale, 32 4-bit quants (Q4_1: a minimum too)
BLOCK = GGML_QUANT_SIZES[Q4_0][0]                   # weights per block
_TURN = 8                                           # bytes of a row's quants per turn in an interleaved block
# ggml flips each 4-bit quant's high bit when it interleaves: 0x88 in every byte of an int64 turn
_FLIPPED = torch.tensor(int.from_bytes(b"\x88" * 8, "little", signed=True), dtype=torch.int64)


class RepackedWeight(GgmlWeight):
    """A Q4_0 weight [out_features, in_features] in ggml's memory, interleaved."""

    def __init__(self, ctx: ggml.Context, tensor: int, ggml_type: int, in_features: int, out_features: int):
        self.ctx, self.tensor = ctx, tensor
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, out_features
        # [groups of 8 rows, blocks per row, 8 scales then 8 rows' quants]
        self.groups = ggml.memory(tensor).view(out_features // GROUP_ROWS, in_features // BLOCK,
                                               GROUP_ROWS * (_SCALE_BYTES + _QUANT_BYTES))
        weakref.finalize(self, ctx.close)
        self.slices: dict[tuple[int, int], QuantizedWeight] = {}     # `_dequantized`'s

    @property
    def nbytes(self) -> int:
        return self.groups.numel()

    def placed_blocks(self, ctx: ggml.Context) -> int:
        """The weight's ggml tensor, for ctx's ops (it lives in its own context, kept as long as ctx)."""
        ctx.hold(self)
        return self.tensor

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
        """Rows of the weight, dequantized (QuantizedWeight.rows) from the groups that hold them, put back in the
        file's layout (under quantized.DEQUANTIZING, as `repacked` and prompt products' slices call `plain`: it writes
        shared memory)."""
        groups, local = _groups(ids)
        return QuantizedWeight(self.plain(groups), self.ggml_type, self.in_features).rows(local, out, threads)

    def dequantize(self, first: int, out: torch.Tensor) -> torch.Tensor:
        """Rows first.. of the weight dequantized into out (`_dequantized`)."""
        return _dequantized(self, self.plain, first, out)

    def plain(self, groups: torch.Tensor, shifts: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks of the given groups' rows (ascending) in the file's layout: uint8 [8 * len(groups), bytes per
        row], valid until the next call (its memory is reused: fresh memory would cost its page faults each
        prompt). A group's interleaved block is 8 scales, then 16 turns of 8 quant bytes, turn t row t % 8's bytes
        8 * (t // 8) onwards: the turns move as int64s, the flipped bits flipped back in the same pass. shifts: a
        ShiftedWeight's, float32 [blocks per row, out_features]: Q4_1 blocks then, each with its minimum 8d less
        than its shift."""
        first, last = groups[0].item(), groups[-1].item()
        whole = last - first + 1 == len(groups)
        g = self.groups[first:last + 1] if whole else self.groups[groups]
        n, blocks = g.shape[:2]
        turns_per_row = _QUANT_BYTES // _TURN
        scale_words = 1 if shifts is None else 2        # Q4_1's minimum after the scale
        block_words = scale_words + _QUANT_BYTES // 2
        out = _scratch("blocks", n * GROUP_ROWS * blocks * block_words * 2).view(torch.int16).view(
            n, GROUP_ROWS, blocks, block_words)
        out[..., 0] = g.view(torch.int16)[..., :GROUP_ROWS].transpose(1, 2)
        if shifts is not None:
            held = shifts[:, first * GROUP_ROWS:(last + 1) * GROUP_ROWS] if whole else shifts[:, _rows_of(groups)]
            # m = shift - 8d, computed in float32 and written as float16 (exact: `_as_q4_0`)
            torch.sub(held.T.view(n, GROUP_ROWS, blocks), out[..., 0].view(torch.float16), alpha=8,
                      out=out[..., 1].view(torch.float16))
        turns = g.view(torch.int64)[..., GROUP_ROWS * _SCALE_BYTES // 8:].view(n, blocks, turns_per_row, GROUP_ROWS)
        rows = _scratch("turns", n * GROUP_ROWS * blocks * _QUANT_BYTES).view(torch.int64).view(
            n, GROUP_ROWS, blocks, turns_per_row)
        torch.bitwise_xor(turns.permute(0, 3, 1, 2), _FLIPPED, out=rows)
        out[..., scale_words:] = rows.view(torch.int16)
        return out.view(torch.uint8).view(n * GROUP_ROWS, -1)


class ShiftedWeight(GgmlWeight):
    """A Q4_1 weight [out_features, in_features] as Q4_0 blocks of its scales and quants, interleaved, and its shifts
    8d + m per block (module doc)."""
    ggml_type = Q4_1

    def __init__(self, base: RepackedWeight, shifts: torch.Tensor):
        self.base = base
        self.shifts = shifts        # float32 [in_features / 32, out_features]: ggml's [out, blocks]
        self.in_features, self.out_features = base.in_features, base.out_features
        self.slices: dict[tuple[int, int], QuantizedWeight] = {}     # `_dequantized`'s

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.shifts.numel() * self.shifts.element_size()

    def placed(self, ctx: ggml.Context) -> Placed:
        return Placed(self.base.placed_blocks(ctx), ctx.place(self.shifts))

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
        """Rows of the weight, dequantized from the file's Q4_1 blocks, put back from the groups that hold them
        (`RepackedWeight.plain`: each block's minimum m = shift − 8d, exact by `_as_q4_0`)."""
        groups, local = _groups(ids)
        plain = self.base.plain(groups, self.shifts)
        return QuantizedWeight(plain, Q4_1, self.in_features).rows(local, out, threads)

    def dequantize(self, first: int, out: torch.Tensor) -> torch.Tensor:
        """Rows first.. of the weight dequantized into out (`_dequantized`), from the file's Q4_1 blocks."""
        return _dequantized(self, lambda groups: self.base.plain(groups, self.shifts), first, out)


def _dequantized(weight: RepackedWeight | ShiftedWeight, plain, first: int, out: torch.Tensor) -> torch.Tensor:
    """Rows first.. of the weight dequantized into out (float32 [rows, in_features]) for a prompt product's slice
    (under quantized.DEQUANTIZING): the slice's blocks put back in the file's layout (plain: a function of the
    groups), then dequantized as the file's blocks are, through ops planned once per slice and kept (its
    `QuantizedWeight.dequantize`, over the memory `plain` reuses: planned again should that memory have grown and
    moved). A graph built per call and the groups found by `torch.unique` took ~0.3 ms a slice, ~35 ms a forward of
    the bundled model. A slice that is not whole groups (none of `dequantized_product`'s, whose slices are) goes
    through `rows`."""
    if first % GROUP_ROWS or len(out) % GROUP_ROWS:
        return weight.rows(torch.arange(first, first + len(out)), out)
    blocks = plain(torch.arange(first // GROUP_ROWS, (first + len(out)) // GROUP_ROWS))
    planned = weight.slices.get((first, len(out)))
    if planned is None or planned.blocks.data_ptr() != blocks.data_ptr():
        planned = weight.slices[first, len(out)] = QuantizedWeight(blocks, weight.ggml_type, weight.in_features)
    return planned.dequantize(0, out)


def _groups(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups of 8 rows that hold rows `ids` (ascending, once each), and each id's place among their rows."""
    ids = ids.long()
    groups, which = torch.unique(ids // GROUP_ROWS, return_inverse=True)
    return groups, which * GROUP_ROWS + ids % GROUP_ROWS


def _rows_of(groups: torch.Tensor) -> torch.Tensor:
    """The rows of the given groups of 8, group by group."""
    return (groups[:, None] * GROUP_ROWS + torch.arange(GROUP_ROWS)).flatten()


_SCRATCH: dict[str, torch.Tensor] = {}     # memory `plain` reuses, by name


def _scratch(name: str, nbytes: int) -> torch.Tensor:
    """nbytes of the memory kept under `name` (grown when too small)."""
    if name not in _SCRATCH or _SCRATCH[name].numel() < nbytes:
        _SCRATCH[name] = torch.empty(nbytes, dtype=torch.uint8)
    return _SCRATCH[name][:nbytes]


def repacked(weight: QuantizedWeight) -> QuantizedWeight | RepackedWeight | ShiftedWeight:
    """The weight in ggml's interleaved layout where that is Q4_0's, or Q4_1's as Q4_0 and shifts, and rounds rows
    alike (module doc); else itself."""
    threads = torch.get_num_threads()
    if weight.ggml_type not in (Q4_0, Q4_1) or weight.out_features % GROUP_ROWS or \
            not _rounds_rows_alike(threads, shifted=weight.ggml_type == Q4_1):
        return weight
    blocks, shifts = _as_q4_0(weight.blocks) if weight.ggml_type == Q4_1 else (weight.blocks, None)
    if blocks is None:
        return weight
    packed = _interleaved(QuantizedWeight(blocks, Q4_0, weight.in_features), threads)
    ends = torch.tensor([0, weight.out_features // GROUP_ROWS - 1])
    # another interleaving than block_q4_0x8's (another ggml, another CPU) would not come back as the file's blocks
    with DEQUANTIZING:      # `plain` writes memory that prompt products share
        same = packed is not None and torch.equal(
            packed.plain(ends), blocks.view(-1, GROUP_ROWS, blocks.shape[1])[ends].flatten(0, 1))
    if not same:
        return weight
    if shifts is None:
        return packed
    # and the Q4_1 rows that prompt products read come back as the file's
    shifted, rows = ShiftedWeight(packed, shifts), _rows_of(ends)
    with DEQUANTIZING:
        return shifted if torch.equal(shifted.rows(rows), weight.rows(rows)) else weight


def _as_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Q4_1 blocks (uint8 [out, bytes per row]) as Q4_0 blocks of the same scales and quants, and the shifts 8d + m
    (float32 [blocks per row, out]); (None, None) where some minimum would not come back from its shift exactly
    (float32 holds 8d + m of two float16s exactly unless their magnitudes lie more than 2^13 apart)."""
    b = blocks.view(len(blocks), -1, 2 * _SCALE_BYTES + _QUANT_BYTES)
    d, m = (b[..., at:at + _SCALE_BYTES].contiguous().view(torch.float16).squeeze(-1).float() for at in (0, 2))
    shifts = 8 * d + m
    if not torch.equal((shifts - 8 * d).half().float(), m):
        return None, None
    q4_0 = torch.cat([b[..., :_SCALE_BYTES], b[..., 2 * _SCALE_BYTES:]], -1).reshape(len(blocks), -1)
    return q4_0, shifts.T.contiguous()


def _interleaved(weight: QuantizedWeight, threads: int) -> RepackedWeight | None:
    """The weight copied into ggml's CPU_REPACK memory; None where ggml has no layout for it here."""
    ctx = ggml.Context(threads, max_tensors=1)
    tensor = ctx.place_repacked(weight.blocks, weight.ggml_type, (weight.in_features, weight.out_features))
    if tensor is None:
        ctx.close()
        return None
    return RepackedWeight(ctx, tensor, weight.ggml_type, weight.in_features, weight.out_features)


@functools.cache
def _rounds_rows_alike(threads: int, shifted: bool) -> bool:
    """Whether ggml's repacked Q4_0 product (shifted: a ShiftedWeight's, whose one row's shifts multiply in a part
    per thread, several rows' a row per thread) gives each of 5 rows (its multi-row kernel takes 4 at a time, the
    fifth alone) bitwise what that row gives alone."""
    generator = torch.Generator().manual_seed(0)
    weight = QuantizedWeight(ggml.quantize(torch.randn(64 * threads, 256, generator=generator) + 1, Q4_1), Q4_1, 256)
    blocks, shifts = _as_q4_0(weight.blocks)
    packed = None if blocks is None else _interleaved(QuantizedWeight(blocks, Q4_0, 256), threads)
    if packed is None:
        return False
    product = ShiftedWeight(packed, shifts).product if shifted else packed.product
    x = torch.randn(5, 256, generator=generator)
    together = product(x)
    return all(torch.equal(product(x[i:i + 1])[0], together[i]) for i in range(len(x)))
