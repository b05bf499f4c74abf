"""Weights kept in GGUF's quantized blocks, and the decoder modules that multiply by them: on CPU through ggml, on
CUDA through kvtier's Triton kernels (the blocks repacked once at load: packed.py, triton_quantized.py).

A GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (and on CPU ggml's other
block types and its F16 and BF16 matrices, which ggml multiplies as they are; on CUDA those are dequantized at load)
stay as the file holds them, so the weights take about the file's memory (on CPU Q4_1 1.1x it, as Q4_0 plus shifts:
repacked.py; on CUDA an untied LM head that tinygemm does not take is kept in bfloat16, and Q4_0 / Q4_1 hold
bfloat16 scales and zeros: int4pack.py);
`--quantize int8|int4` makes Q8_0 or Q4_0 blocks (weight-only, groups of 32) of a float checkpoint the same way.

Which product a row gets depends on its token's role, never on what else is in the step, so a sequence's output
does not change with the traffic beside it (but for what the cache held of its prompt, below):
- decode rows: a product over the blocks, which reads 4-8x fewer bytes than float weights. On CPU ggml's (the
  activations quantized to 8 bits per block of 32, as llama.cpp does; over F16 and BF16 weights rounded to that
  type, where a value past float16's 65504 overflows as in llama.cpp), whole decode steps as one ggml graph
  (ggml_decoder.py), Q4_0 projections (and Q4_1 ones, as Q4_0 plus a shift per block) in ggml's interleaved
  layout, whose multi-row kernel rounds each row as it would alone (repacked.py); on CUDA a Triton kernel that
  dequantizes tiles in registers into the activations' dtype;
- prompt rows: the weight dequantized, a slice at a time, for torch's product: on CUDA in the activations' dtype;
  on CPU in bfloat16 where the CPU has bfloat16 dot products (AVX512-BF16, AMX; `products.dequantized_dtype`),
  else in float32 (F16 weights always in float32: bfloat16 would round their values). torch's float32 product
  multiplies 512 rows 1.4-2x faster than ggml's Q4_0, Q4_1 and Q8_0 kernels (the wheel's AVX2 build; Q4_K about
  even; `kvtier bench kernels`), its bfloat16 product about 2x faster again: prefill 1.13-1.23x as fast as with
  float32 weights on a 2-core EPYC (two runs);
- a prompt's last token, on CPU (the row its first token is sampled from, cached or not): over
  the blocks to about float32's precision (`ggml.precise_product`: the row as the product rounds it, to 8 bits or
  to a 16-bit weight's type, and what that rounding left out, side by side through ggml's product), in the layers
  and the LM head; in ggml's decode graph (ggml_decoder.py) or, where a forward runs it op by op, through
  `GgmlWeight.precise_product`. A fully cached prompt dequantizes no weight: a 1024-token one's first token came
  1.9-2.6x sooner than dequantizing every weight for its one row (eagerly; 2.4x sooner again in the graph), and its
  first-token logits sit 0.05-0.17% of the largest from the dequantized weights' (1.0-1.2% with the LM head's
  activations in 8 bits, as decode rows have them; a whole row in 8 bits, 2.5%, turned the bundled model's answer
  to "What is the capital of France?" away from Paris).
A short prompt's rows (runner.SHORT_PROMPT_TOKENS: an agent's turn after a cached prefix) run in ggml's decode graph
as decode rows, its last token precise: dequantizing every weight for a few rows took longer than their products.
What is short depends on what the cache held of the prompt (`KVState.held_tokens`), not on whether compute-or-load
restored that or computed it again; what the held part's K/V hold does (restored, or computed again in another
chunk: ~1.5e-3 apart in a tiny model's log-probabilities), so greedy output can differ where two tokens nearly tie.
`Decoder.forward` says which rows decode and which are a prompt's last token (`decoding`); the others are prompt
rows. On CPU the decode rows' quantized activations and the prompt rows' bfloat16 round differently from
float32's, so greedy output can differ from float32 weights' where two tokens nearly tie, and a prompt whose last
tokens were computed in another chunk (a prefix cache hit) can differ likewise.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
import xxhash
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_from_byte_shape, quant_shape_to_byte_shape
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kvtier.models import ggml
from kvtier.models.int4pack import Int4PackWeight
from kvtier.models.packed import PackedWeight
from kvtier.models.products import cached_weight_product, dequantized_dtype
from kvtier.openmp import stop_spinning

# the block cache's format: each tensor's metadata is "type,in_features,xxh3 digest of its blocks"
BLOCKS_FORMAT_KEY, BLOCKS_FORMAT = "__format__", "kvtier-blocks-2"
DEQUANTIZED_BYTES = 64 << 20     # the most weight a prompt row's product dequantizes at once, in x's dtype
# one prompt product at a time in the process: they share the dequantization buffers (and repacked weights their
# scratch memory), which two engines' threads would otherwise write at once
DEQUANTIZING = threading.Lock()
_ROLES: contextvars.ContextVar[_Roles | None] = contextvars.ContextVar("roles", default=None)   # `decoding`
# bumped when decode rows' products over the blocks change what they compute, so that KV saved before is a miss
# (2: Q4_1 as Q4_0 plus shifts, repacked.py)
DECODE_PRODUCTS = 2
# `--quantize`: the block type of every projection; embeddings and the LM head take Q8_0 in both
QUANTIZE_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_0}


@dataclass(frozen=True)
class _Roles:
    """Which rows of a forward's inputs take which product (`decoding`), found once for all its projections."""
    decode: torch.Tensor | None         # decode rows' indices, None where there are none
    last: torch.Tensor | None           # a prompt's last token's rows
    prompt: torch.Tensor | None         # the other prompt rows'


@dataclass(frozen=True)
class Placed:
    """A weight's tensors in a ggml context (`GgmlWeight.placed`), and the ops of its products there: its blocks,
    and where the weight is those blocks plus a shift per block of 32 weights (repacked.ShiftedWeight), the shifts
    [out, in / 32] in float32."""
    blocks: int
    shifts: int | None = None

    def product(self, ctx: ggml.Context, x: int, precise: bool = False) -> int:
        """The weight times x [in, rows] (float32): as ggml's product over the blocks rounds x, or to about
        float32's precision (`ggml.precise_product`); the shifts' part in float32 either way."""
        y = ggml.precise_product(ctx, self.blocks, x) if precise else ctx.op("mul_mat", self.blocks, x)
        return y if self.shifts is None else ctx.op("add", y, ggml.block_sums_product(ctx, self.shifts, x))


def _product(ctx: ggml.Context, placed: Placed, x: int) -> int:
    return placed.product(ctx, x)


def _precise_product(ctx: ggml.Context, placed: Placed, x: int) -> int:
    return placed.product(ctx, x, precise=True)


class GgmlWeight:
    """What a weight in ggml's blocks does through its `placed` tensors and its `rows`, in whichever layout it keeps
    them (QuantizedWeight: the file's; repacked.RepackedWeight: ggml's interleaved one; repacked.ShiftedWeight: Q4_1
    as an interleaved Q4_0 weight plus shifts)."""

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    def placed(self, ctx: ggml.Context) -> Placed:
        """The weight's tensors in ctx, for its products there."""
        return Placed(self.placed_blocks(ctx))

    def dequantize(self, first: int, out: torch.Tensor) -> torch.Tensor:
        """Rows first.. of the weight dequantized into out (float32 [rows, in_features]): a prompt product's slice,
        each layout through ops it keeps (`dequantized_product`)."""
        raise NotImplementedError

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] float32 @ weight.T, through ggml."""
        return weight_op(_product, self, ggml.aligned(x), x.new_empty(x.shape[0], self.out_features),
                         torch.get_num_threads())

    def precise_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] float32 @ weight.T over the blocks, to about float32's precision
        (`ggml.precise_product`), in 1.2-1.7x the time of one row's product (the bundled model's projections) and
        never the whole weight dequantized. A row at a time, each as it would come alone (`_precise_row`, whose
        result may be memory it reuses)."""
        y = x.new_empty(len(x), self.out_features)
        for row, out in zip(x.split(1), y.split(1)):
            out.copy_(self._precise_row(row))
        return y

    def _precise_row(self, row: torch.Tensor) -> torch.Tensor:
        """row [1, in_features] @ weight.T precisely, through a graph built for the call."""
        return weight_op(_precise_product, self, ggml.aligned(row), row.new_empty(1, self.out_features),
                         torch.get_num_threads())

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 (at load, on torch's threads)."""
        return self.rows(torch.arange(self.out_features), threads=torch.get_num_threads())


@dataclass
class QuantizedWeight(GgmlWeight):
    """A weight [out_features, in_features] as ggml blocks (or a GGUF's F16 / BF16 values): uint8 [out_features,
    bytes per row], rows as GGUF files lay them out."""
    blocks: torch.Tensor
    ggml_type: int
    in_features: int
    # ops planned once and kept: dequantize's per slice of rows, memory they write and threads (first row, rows,
    # out's address, threads), precise_product's per threads ("precise_product", threads)
    plans: dict[tuple, ggml.Planned] = field(default_factory=dict, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def placed_blocks(self, ctx: ggml.Context) -> int:
        """The weight as a ggml tensor of ctx, over these blocks."""
        return ctx.place(self.blocks, self.ggml_type, (self.in_features, self.out_features))

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
        """Rows of the weight, dequantized: float32 [len(ids), in_features] (into out when given). On one thread by
        default: between a prompt chunk's products torch's threads still spin, and a second ggml thread fighting
        them took 2x as long (a 512-token prefill of the bundled model dequantizes 57 ms on two threads, 27 on
        one)."""
        out = torch.empty(len(ids), self.in_features) if out is None else out
        return weight_op("get_rows", self, ggml.aligned(ids.to(torch.int32)), out, threads)

    def _precise_row(self, row: torch.Tensor) -> torch.Tensor:
        """row [1, in_features] @ weight.T precisely, through an op planned once per threads and kept: the products
        a prompt's last token takes forward after forward (a graph built per call cost ~0.2 ms)."""
        threads = torch.get_num_threads()
        key = ("precise_product", threads)
        if key not in self.plans:
            with torch.inference_mode(False):      # memory written in place in inference mode and out of it
                self.plans[key] = ggml.Op(_precise_product, self.placed, torch.empty(1, self.in_features),
                                          torch.empty(1, self.out_features), threads)
        op = self.plans[key]
        op.x.copy_(row)
        return op.compute()

    def dequantize(self, first: int, out: torch.Tensor) -> torch.Tensor:
        """Rows first.. of the weight dequantized into out (float32 [rows, in_features]), through an op planned at
        the first call for that slice, memory and threads and kept: prompt rows dequantize the same slices into the
        same buffer forward after forward, and a graph built per call cost ~0.2 ms, ~25 ms a forward of the bundled
        model. The K-quants and BF16 on torch's threads (`ggml.Copy`, torch's own stopped spinning first: `rows`
        says what they cost), the other types on one (ggml's get_rows: its copy takes their blocks of 32 one call
        each, as slow on two threads as get_rows on one)."""
        threads = torch.get_num_threads() if _dequantized_on_threads(self.ggml_type) else 1
        key = (first, len(out), out.data_ptr(), threads)
        if key not in self.plans:
            if threads == 1:
                ids = torch.arange(first, first + len(out), dtype=torch.int32)
                self.plans[key] = ggml.Op("get_rows", self.placed_blocks, ids, out, threads=1)
            else:
                self.plans[key] = ggml.Copy(functools.partial(self._placed_rows, first, len(out)), out, threads)
        if threads > 1:
            stop_spinning()
        return self.plans[key].compute()

    def _placed_rows(self, first: int, rows: int, ctx: ggml.Context) -> int:
        """Rows first.. of the weight as a ggml view of its blocks in ctx."""
        blocks = self.placed_blocks(ctx)
        _, (_, stride, *_) = ggml.shape(blocks)
        return ctx.op("view_2d", blocks, self.in_features, rows, stride, first * stride)


def _dequantized_on_threads(ggml_type: int) -> bool:
    """Whether prompt products dequantize weights of this type on torch's threads: blocks of 256 (the K-quants) and
    BF16 (`QuantizedWeight.dequantize`)."""
    return ggml_type == ggml.BF16 or GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0] >= 256


def quantize(weight: torch.Tensor, ggml_type: int) -> QuantizedWeight:
    return QuantizedWeight(ggml.quantize(weight, int(ggml_type)), int(ggml_type), weight.shape[1])


def in_blocks(ggml_type: int) -> bool:
    """Whether a GGUF tensor type is one of ggml's quantized block types (not a float or integer array)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0] > 1


def kept_as_file(ggml_type: int) -> bool:
    """Whether a GGUF matrix of this type stays as the file holds it: ggml's block types, and 16-bit floats, which
    float32 would double (ggml multiplies them as they are)."""
    return in_blocks(ggml_type) or ggml_type in (ggml.F16, ggml.BF16)


def from_gguf_bytes(data: np.ndarray, ggml_type: int, out_features: int) -> QuantizedWeight:
    """A GGUF tensor's data (the reader's array: a row of bytes per weight row, or of float16 values), copied out of
    the file map into torch's (aligned) memory."""
    data = data.view(np.uint8)
    blocks = torch.empty(out_features, data.size // out_features, dtype=torch.uint8)
    blocks.numpy()[:] = data.reshape(out_features, -1)
    _, in_features = quant_shape_from_byte_shape(blocks.shape, GGMLQuantizationType(ggml_type))
    return QuantizedWeight(blocks, int(ggml_type), in_features)


def from_16_bit(weight: torch.Tensor) -> QuantizedWeight:
    """A checkpoint's bfloat16 or float16 matrix [out, in] as ggml's BF16 / F16 weight: its bytes copied into
    torch's (aligned) memory, out of the file map safetensors may hand them in."""
    return QuantizedWeight(weight.view(torch.uint8).clone(memory_format=torch.contiguous_format),
                           ggml.TORCH_TYPES[weight.dtype], weight.shape[1])


def concatenated(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Weights stacked along their rows (q/k/v, gate/up): one weight where their block types agree."""
    if len({p.ggml_type for p in parts}) > 1 or len({p.in_features for p in parts}) > 1:
        return parts
    return [QuantizedWeight(torch.cat([p.blocks for p in parts]), parts[0].ggml_type, parts[0].in_features)]


def weight_op(op: str | Callable, weight: GgmlWeight, x: torch.Tensor, out: torch.Tensor,
              threads: int) -> torch.Tensor:
    """One ggml op of a weight's blocks and x, or the ops a function of (ctx, the weight `placed`, x) builds,
    computed into out on ggml's threadpool of `threads`, through a graph built for this call."""
    planned = ggml.Op(op, weight.placed_blocks if isinstance(op, str) else weight.placed, x, out, threads)
    try:
        return planned.compute()
    finally:
        planned.close()


@functools.cache
def _dequantized_buffer(device: torch.device, dtype: torch.dtype, elements: int) -> torch.Tensor:
    """Where prompt rows' products dequantize their weights, reused product after product (the engine thread's, in
    stream order on CUDA): fresh memory each time would cost its page faults, about a fifth of a 512-token prefill
    on CPU. On CPU ggml dequantizes into float32, and a bfloat16 product takes a copy in a second buffer: a normal
    tensor, which torch writes in place in inference mode and out of it alike."""
    with torch.inference_mode(False):
        return torch.empty(elements, dtype=dtype, device=device)


def prompt_dtype(dtype: torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """The dtype in which prompt rows of activations in `dtype` multiply by dequantized weights: float32 ones on CPU
    in `dequantized_dtype()`, others in their own."""
    return dequantized_dtype() if device_type == "cpu" and dtype == torch.float32 else dtype


def weight_prompt_dtype(ggml_type: int, dtype: torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """The dtype in which prompt rows of activations in `dtype` multiply by a weight of this type dequantized: an F16
    weight's in `dtype` (bfloat16 would round its values), the others' in `prompt_dtype`."""
    return dtype if ggml_type == ggml.F16 else prompt_dtype(dtype, device_type)


def dequantized_product(weight: GgmlWeight | PackedWeight | Int4PackWeight, x: torch.Tensor,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [rows, in_features] @ weight.T, returned in x's dtype, the weight dequantized DEQUANTIZED_BYTES at a time
    (an LM head of 128K rows would take 2 GB at once). dtype: what the product multiplies in, by default
    `prompt_dtype` (`kvtier bench kernels` sets it)."""
    cpu = x.device.type == "cpu"
    if dtype is None:
        dtype = weight_prompt_dtype(weight.ggml_type, x.dtype, x.device.type)
    elements = DEQUANTIZED_BYTES // x.dtype.itemsize
    step = max(8, elements // weight.in_features // 8 * 8)     # whole groups of a repacked weight's 8 rows
    buffer = _dequantized_buffer(x.device, x.dtype, elements)
    copy = _dequantized_buffer(x.device, dtype, elements) if dtype != x.dtype else None
    multiply = cached_weight_product(dtype, len(x)) if cpu else F.linear
    xs = x.to(dtype)
    slices = []
    with DEQUANTIZING:
        for a in range(0, weight.out_features, step):
            n = min(step, weight.out_features - a)
            w = _dequantized_slice(weight, a, buffer[:n * weight.in_features].view(n, weight.in_features))
            if copy is not None:
                w = copy[:w.numel()].view_as(w).copy_(w)
            slices.append(multiply(xs, w, None))
    return _joined(slices).to(x.dtype)


def _dequantized_slice(weight: GgmlWeight | PackedWeight | Int4PackWeight, first: int,
                       out: torch.Tensor) -> torch.Tensor:
    """Rows first.. of the weight dequantized into out: ggml's blocks through their planned ops (in the file's
    layout, or put back in it from the repacked one), weights packed for CUDA through `rows`."""
    if isinstance(weight, GgmlWeight):
        return weight.dequantize(first, out)
    return weight.rows(torch.arange(first, first + len(out), dtype=torch.int32, device=out.device), out)


def _joined(ys: list[torch.Tensor]) -> torch.Tensor:
    """Products side by side along the output (torch.cat copies even one)."""
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


@contextlib.contextmanager
def decoding(rows: torch.Tensor, last: torch.Tensor | None = None):
    """Within it, the rows of the products' inputs marked True in `rows` (bool [rows]) are decode rows, and those
    marked in `last` a prompt's last token (on CPU, cached or not: runner.py), which ggml's weights multiply to
    about float32's precision over their blocks (`GgmlWeight.precise_product`); the others are prompt rows."""
    last = torch.zeros_like(rows) if last is None else last
    token = _ROLES.set(_Roles(*(mask.nonzero().flatten() if mask.any() else None
                                for mask in (rows, last, ~(rows | last)))))
    try:
        yield
    finally:
        _ROLES.reset(token)


class QuantizedLinear(nn.Module):
    """A projection over quantized weights (ggml's blocks on CPU, packed ones on CUDA, Q4_0 and Q4_1 in tinygemm's
    layout): parts stacked along the output (fused q/k/v or gate/up whose block types differ), and an optional float
    bias."""

    def __init__(self, parts: list[QuantizedWeight] | list[PackedWeight | Int4PackWeight], bias: torch.Tensor | None):
        super().__init__()
        self.parts = parts
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        roles = _ROLES.get()
        if roles is None:
            return self._with_bias(self._dequantized_product(x))
        products = [(rows, product) for rows, product in ((roles.decode, self._quantized_product),
                                                          (roles.last, self._precise_product),
                                                          (roles.prompt, self._dequantized_product))
                    if rows is not None]
        if len(products) == 1:
            return self._with_bias(products[0][1](x))
        if roles.prompt is not None and x.device.type == "cpu":
            # on CPU the prompt rows' product over every row, the others' put in its place: a few rows more is
            # cheaper there than gathering a chunk's rows and scattering their products (~1 ms a projection)
            y, products = self._dequantized_product(x), products[:-1]
        else:
            y = x.new_empty(len(x), self.out_features)
        for rows, product in products:
            rows = rows.to(x.device)
            y[rows] = product(x[rows])
        return self._with_bias(y)

    def _with_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def _quantized_product(self, x: torch.Tensor) -> torch.Tensor:
        return _joined([p.product(x) for p in self.parts])

    def _precise_product(self, x: torch.Tensor) -> torch.Tensor:
        return _joined([p.precise_product(x) for p in self.parts])

    def _dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        return _joined([dequantized_product(p, x) for p in self.parts])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"types={[p.type_name for p in self.parts]}"


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight | PackedWeight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight: quantized blocks and float parameters."""
    blocks = {id(p): p.nbytes for m in model.modules()
              for p in (getattr(m, "parts", None) or ([m.weight] if isinstance(m, QuantizedEmbedding) else []))}
    return sum(blocks.values()) + sum(p.numel() * p.element_size() for p in model.parameters())


class LoadQuantizer:
    """How a loader keeps each float tensor it reads: in dtype, or under `--quantize int8|int4` (mode) quantized at
    once, so that a load never holds the model in floats (an 8B checkpoint in float32 on CPU: 32 GB): every
    projection in mode's block type, the embedding and LM head in Q8_0; a matrix whose rows are not whole blocks of
    32 stays float, in dtype. The blocks come from the checkpoint's own values, whatever dtype. cache: a file that
    keeps the blocks for the next start (named by the weights' fingerprint, so it never serves other weights); a
    damaged weight in it (each weight's digest is checked as it is read: xxh3, several GB/s), or one that does not
    fit its name's shape and type, is made again. float_head: an untied LM head stays in dtype (a GPU's packed
    kernels take it so, and blocks made of it would only be dequantized again, rounded twice)."""

    def __init__(self, mode: str | None, dtype: torch.dtype, cache: str | None = None, float_head: bool = False):
        self.kind, self.dtype, self.cache = mode and QUANTIZE_TYPES[mode], dtype, cache
        self.float_head = float_head
        self.cached = _read_blocks(cache) if cache else None
        self.made: dict[str, QuantizedWeight] = {}
        self.remade = False     # some blocks made by this load, not read from the cache: the file is written (again)

    def take(self, name: str, shape: tuple[int, ...], read) -> torch.Tensor | QuantizedWeight:
        """The weight `name` of `shape` as kept: its cached blocks (then `read`, which returns the float tensor, is
        never called: a second start reads no float weight it quantizes), or read and quantized, or read in dtype."""
        if self.kind is None or len(shape) != 2 or shape[1] % 32 or (self.float_head and name == "lm_head.weight"):
            return read().to(self.dtype)
        kind = int(self.kind if name.endswith("_proj.weight") else GGMLQuantizationType.Q8_0)
        made = (self.cached or {}).get(name)
        if made is None or not _fits(made, kind, shape):     # not cached, or cached of another shape or type
            made, self.remade = quantize(read(), kind), True
        self.made[name] = made
        return made

    def finish(self) -> None:
        """Write the blocks made by this load where no readable cache was found or where it lacked some: an untied
        head a GPU start kept in dtype (which a CPU start quantizes once), a damaged weight, one of another shape."""
        if self.cache and self.remade:
            _write_blocks(self.cache, {**(self.cached or {}), **self.made})


def _fits(weight: QuantizedWeight, ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether cached blocks are those of a weight of `shape` in `ggml_type` (a file of other weights, written by
    another version, would otherwise reach ggml, which aborts the process on a tensor of the wrong size)."""
    return weight.ggml_type == ggml_type and weight.in_features == shape[1] and \
        tuple(weight.blocks.shape) == quant_shape_to_byte_shape(shape, GGMLQuantizationType(ggml_type))


def _read_blocks(path: str) -> dict[str, QuantizedWeight] | None:
    """The weights a cache file keeps, each whose bytes match the digest written with them (a damaged one is left
    out, so quantized again); None where the file is missing, unreadable or of another format."""
    try:
        with safe_open(path, framework="pt") as f:
            kinds = f.metadata() or {}
            if kinds.get(BLOCKS_FORMAT_KEY) != BLOCKS_FORMAT:
                return None
            found = {}
            for name in f.keys():
                ggml_type, in_features, digest = kinds[name].split(",")
                blocks = f.get_tensor(name)
                if _digest(blocks) == digest:
                    found[name] = QuantizedWeight(ggml.aligned(blocks), int(ggml_type), int(in_features))
            return found
    except Exception:   # missing, damaged or from another version: quantized again
        return None


def _write_blocks(path: str, weights: dict[str, QuantizedWeight]) -> None:
    """Through a file of this writer's own (two loads of one model may write at once), moved into place whole."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".blocks-", suffix=".partial")
    os.close(fd)
    try:
        save_file({n: w.blocks for n, w in weights.items()}, partial,
                  metadata={BLOCKS_FORMAT_KEY: BLOCKS_FORMAT} |
                  {n: f"{w.ggml_type},{w.in_features},{_digest(w.blocks)}" for n, w in weights.items()})
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _digest(blocks: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(blocks.contiguous().numpy())
