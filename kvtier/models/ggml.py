"""ggml's CPU kernels over GGUF's own quantized blocks, through ctypes and the prebuilt `libggml-python` wheel (shared
libraries only, nothing compiled at install).

A `Context` holds ggml tensors' metadata: tensors placed at torch memory (weights, the KV pool, a step's inputs and
outputs) and the ops between them. A `Graph` over a context's outputs gets its intermediates from ggml's graph
allocator and a plan on a threadpool that lives as long as the process, so running it again costs one ggml compute.
`Op` is such a graph for one op of a weight, `Product` one for a matrix product. `precise_product` builds a weight's
product to about float32's precision, in the decode graphs and in an `Op` alike.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import weakref
from typing import Callable

import numpy as np
import torch

_P = ctypes.c_void_p
_I, _I64, _F, _SZ, _B = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_size_t, ctypes.c_bool
# struct ggml_threadpool_params: bool cpumask[GGML_MAX_N_THREADS = 512]; int n_threads; enum prio; uint32_t poll; ...
_POLL_OFFSET = 512 + 4 + 4
F32, F16, BF16, I32, I64 = 0, 1, 30, 26, 27     # ggml_type numbers (GGUF's numbering) of the plain types
Q8_0, Q8_1, Q8_K = 8, 9, 15                # the 8-bit types ggml rounds activations to for its products
ROUNDED_ACTIVATIONS = (Q8_0, Q8_1, Q8_K, F16, BF16)    # what products round activations to (`rounded_as_activations`)
ROPE_NEOX = 2                               # Hugging Face's rotate_half layout
POOL_MAX = 0                                # enum ggml_op_pool
TORCH_TYPES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16, torch.int32: I32, torch.int64: I64}
_LOG_WARN, _LOG_ERROR = 3, 4                # enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, _P)
log = logging.getLogger("kvtier.ggml")


@_LOG_CALLBACK
def _log_ggml(level: int, text: bytes, _) -> None:
    """ggml's warnings and errors into kvtier's log; its debug and info lines (one per weight it repacks) dropped."""
    if level in (_LOG_WARN, _LOG_ERROR):
        log.warning("%s", text.decode(errors="replace").rstrip())


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", _SZ), ("mem_buffer", _P), ("no_alloc", _B)]


class _CPlan(ctypes.Structure):     # ggml-cpu.h, struct ggml_cplan
    _fields_ = [("work_size", _SZ), ("work_data", _P), ("n_threads", _I), ("threadpool", _P),
                ("abort_callback", _P), ("abort_callback_data", _P), ("use_ref", _B)]


class _TypeTraitsCpu(ctypes.Structure):    # ggml-cpu.h, struct ggml_type_traits_cpu
    _fields_ = [("from_float", _P), ("vec_dot", _P), ("vec_dot_type", _I), ("nrows", _I64)]


class _TensorHead(ctypes.Structure):   # the fields of ggml.h's struct ggml_tensor up to `extra`
    _fields_ = [("type", _I), ("buffer", _P), ("ne", _I64 * 4), ("nb", _SZ * 4), ("op", _I), ("op_params", _I * 16),
                ("flags", _I), ("src", _P * 10), ("view_src", _P), ("view_offs", _SZ), ("data", _P),
                ("name", ctypes.c_char * 64), ("extra", _P)]


# name → (return type, argument types after the context, or all of them where the name is marked with !)
_FUNCTIONS = {
    "ggml_init": (_P, [_InitParams]), "!ggml_free": (None, [_P]),
    "!ggml_tensor_overhead": (_SZ, []), "!ggml_get_mem_buffer": (_P, [_P]), "!ggml_get_mem_size": (_SZ, [_P]), "!ggml_graph_overhead_custom": (_SZ, [_SZ, _B]),
    "ggml_new_tensor_4d": (_P, [_I, _I64, _I64, _I64, _I64]),
    "!ggml_nbytes": (_SZ, [_P]), "!ggml_row_size": (_SZ, [_I, _I64]),
    "!ggml_quantize_chunk": (_SZ, [_I, _P, _P, _I64, _I64, _I64, _P]),
    "ggml_mul_mat": (_P, [_P, _P]), "ggml_add": (_P, [_P, _P]), "ggml_mul": (_P, [_P, _P]),
    "ggml_sum_rows": (_P, [_P]), "ggml_repeat_4d": (_P, [_P, _I64, _I64, _I64, _I64]),
    "ggml_get_rows": (_P, [_P, _P]), "ggml_set_rows": (_P, [_P, _P, _P]), "ggml_rms_norm": (_P, [_P, _F]),
    "ggml_swiglu_split": (_P, [_P, _P]), "ggml_concat": (_P, [_P, _P, _I]),
    "ggml_reshape_2d": (_P, [_P, _I64, _I64]),
    "ggml_view_2d": (_P, [_P, _I64, _I64, _SZ, _SZ]), "ggml_view_3d": (_P, [_P, _I64, _I64, _I64, _SZ, _SZ, _SZ]),
    "ggml_view_4d": (_P, [_P, _I64, _I64, _I64, _I64, _SZ, _SZ, _SZ, _SZ]),
    "ggml_rope_ext": (_P, [_P, _P, _P, _I, _I, _I, _F, _F, _F, _F, _F, _F]),
    "ggml_soft_max_ext": (_P, [_P, _P, _F, _F]), "ggml_out_prod": (_P, [_P, _P]),
    "ggml_reshape_3d": (_P, [_P, _I64, _I64, _I64]), "ggml_permute": (_P, [_P, _I, _I, _I, _I]),
    "ggml_cont": (_P, [_P]), "ggml_cpy": (_P, [_P, _P]), "ggml_sub": (_P, [_P, _P]), "ggml_div": (_P, [_P, _P]),
    "ggml_abs": (_P, [_P]), "ggml_round": (_P, [_P]), "ggml_scale_bias": (_P, [_P, _F, _F]),
    "ggml_pool_1d": (_P, [_P, _I, _I, _I, _I]),
    "ggml_new_graph_custom": (_P, [_SZ, _B]), "!ggml_build_forward_expand": (None, [_P, _P]),
    "!ggml_gallocr_new": (_P, [_P]), "!ggml_gallocr_alloc_graph": (_B, [_P, _P]), "!ggml_gallocr_free": (None, [_P]),
    "!ggml_backend_tensor_alloc": (_I, [_P, _P, _P]), "!ggml_backend_buffer_free": (None, [_P]),
    "!ggml_backend_cpu_buffer_from_ptr": (_P, [_P, _SZ]), "!ggml_backend_cpu_buffer_type": (_P, []),
    "!ggml_graph_plan": (_CPlan, [_P, _I, _P]), "!ggml_graph_compute": (_I, [_P, ctypes.POINTER(_CPlan)]),
    "!ggml_backend_cpu_reg": (_P, []), "!ggml_backend_reg_dev_get": (_P, [_P, _SZ]),
    "!ggml_backend_reg_get_proc_address": (_P, [_P, ctypes.c_char_p]),
    "!ggml_backend_buft_alloc_buffer": (_P, [_P, _SZ]), "!ggml_backend_buft_get_alloc_size": (_SZ, [_P, _P]),
    "!ggml_backend_buffer_get_base": (_P, [_P]), "!ggml_backend_tensor_set": (None, [_P, _P, _SZ, _SZ]),
    "!ggml_get_type_traits_cpu": (ctypes.POINTER(_TypeTraitsCpu), [_I]), "!ggml_cpu_has_avx512": (_I, []),
}


class _Lib:
    """The ggml functions kvtier calls (named without their `ggml_` prefix), and one threadpool of `threads`
    threads."""

    def __init__(self, threads: int):
        import libggml
        directory = os.path.join(os.path.dirname(libggml.__file__), "lib64")
        # kept to themselves, bound at load and to each other first: another ggml in the process (llama.cpp's, for
        # the benchmarks) neither takes their symbols nor lends them its own
        mode = os.RTLD_LOCAL | os.RTLD_NOW | os.RTLD_DEEPBIND
        libs = [ctypes.CDLL(os.path.join(directory, f"libggml-{name}.so"), mode=mode) for name in ("base", "cpu")]
        for marked, (restype, argtypes) in _FUNCTIONS.items():
            name = marked.lstrip("!")
            f = getattr(libs[0], name, None) or getattr(libs[1], name)
            # ops and tensor constructors take the context first
            f.restype, f.argtypes = restype, argtypes if marked.startswith("!") or name == "ggml_init" else [_P] + argtypes
            setattr(self, name.removeprefix("ggml_"), f)
        libs[0].ggml_log_set.argtypes = [_LOG_CALLBACK, _P]
        libs[0].ggml_log_set(_log_ggml, None)
        params = ctypes.create_string_buffer(1024)      # struct ggml_threadpool_params (~530 bytes), filled by ggml
        libs[0].ggml_threadpool_params_init.argtypes = [_P, _I]
        libs[0].ggml_threadpool_params_init(params, threads)
        # poll 0: its threads sleep between graphs instead of spinning, which would starve torch's threads
        ctypes.c_uint32.from_buffer(params, _POLL_OFFSET).value = 0
        libs[1].ggml_threadpool_new.restype, libs[1].ggml_threadpool_new.argtypes = _P, [_P]
        self.threads = threads
        self.float_step = 64 if self.cpu_has_avx512() else 32     # floats per step of ggml's float32 loops
        self.threadpool = libs[1].ggml_threadpool_new(params)
        self.computing = threading.Lock()      # one graph at a time on the threadpool (two engines' threads share it)


def available() -> bool:
    """Whether ggml's libraries are here to load (the wheel's Linux build: kvtier loads its .so files)."""
    try:
        import libggml
    except ImportError:
        return False
    directory = os.path.join(os.path.dirname(libggml.__file__), "lib64")
    return sys.platform.startswith("linux") and all(
        os.path.isfile(os.path.join(directory, f"libggml-{name}.so")) for name in ("base", "cpu"))


@functools.cache
def lib(threads: int) -> _Lib:
    return _Lib(threads)


def quantize(weight: torch.Tensor, ggml_type: int, threads: int = 1) -> torch.Tensor:
    """A float weight [out, in] as ggml blocks of `ggml_type` (GGUF's numbering): uint8 [out, bytes per row]."""
    g = lib(threads)
    rows, cols = weight.shape
    src = weight.detach().float().contiguous()
    out = torch.empty(rows, g.row_size(ggml_type, cols), dtype=torch.uint8)
    g.quantize_chunk(ggml_type, src.data_ptr(), out.data_ptr(), 0, rows, cols, None)
    return out


@functools.cache
def activation_type(ggml_type: int) -> int:
    """The type ggml's CPU products over weights of `ggml_type` round activations to first (Q8_0, Q8_1, Q8_K for the
    block types; F16 and BF16 for their own)."""
    return lib(1).get_type_traits_cpu(ggml_type).contents.vec_dot_type


def tensor_type(tensor: int) -> int:
    return _TensorHead.from_address(tensor).type


def precise_product(ctx: Context, weight: int, x: int) -> int:
    """weight [in, out] times x [in, rows] (float32, contiguous) to about float32's precision. ggml's product over
    blocks rounds activations to 8 bits a block first (`activation_type`), and over 16-bit floats to their type, so x
    goes as two: that rounding, which the product then takes exactly, and what the rounding left out; their products
    add up. ~1e-4 of the largest output from the dequantized weight's product, against ~1e-2 for x in 8 bits (Q4_1's
    and Q5_1's Q8_1 keeps its block sums in float16: ~1e-4 off; over a 16-bit weight the left-out part is rounded
    to that type in turn: about 16 bits of x's 24). Each row comes out as it would alone. A float32 weight's product
    is its plain one."""
    kind = activation_type(tensor_type(weight))
    if kind not in ROUNDED_ACTIVATIONS:
        return ctx.op("mul_mat", weight, x)
    rounded = rounded_as_activations(ctx, x, kind)
    # the two side by side in one product: the weight read once
    pairs = ctx.op("mul_mat", weight, ctx.op("concat", rounded, ctx.op("sub", x, rounded), 1))
    (out, rows, *_), (_, stride, *_) = shape(pairs)
    return ctx.op("add", *(ctx.op("view_2d", pairs, out, rows // 2, stride, half * rows // 2 * stride)
                           for half in (0, 1)))


def block_sums_product(ctx: Context, weight: int, x: int) -> int:
    """weight [out, in / 32] (float32) times the sums of x [in, rows]'s blocks of 32 (float32): [out, rows]. Taken as
    a sum of outer products, which ggml runs as scaled adds of the weight's columns, its threads a row each; its dot
    products over 18 sums (a 576-wide row's) took ~3x as long. One row's outputs are cut in a part per thread, so
    that no thread waits. Each row comes out as it would alone."""
    (size, rows, *_), (item, stride, *_) = shape(x)
    if stride != size * item:       # ggml would abort the process at the reshape below
        raise ValueError("block sums need x's rows whole and side by side")
    blocks = size // 32
    sums = ctx.op("sum_rows", ctx.op("reshape_2d", x, 32, blocks * rows))     # [1, blocks * rows]
    (out, *_), (_, weight_stride, *_) = shape(weight)
    parts = ctx.lib.threads
    # each part whole steps of ggml's float32 loops, as the whole row takes them
    if rows > 1 or parts == 1 or out % (ctx.lib.float_step * parts):
        return ctx.op("out_prod", weight, ctx.op("permute", ctx.op("reshape_2d", sums, blocks, rows), 1, 0, 2, 3))
    # [out / parts, blocks, parts] of the weight times the row's sums [1, blocks], repeated for each part
    cut = ctx.op("view_3d", weight, out // parts, blocks, parts, weight_stride, out // parts * item, 0)
    each = ctx.op("repeat_4d", ctx.op("reshape_3d", sums, 1, blocks, 1), 1, blocks, parts, 1)
    return ctx.op("reshape_2d", ctx.op("out_prod", cut, each), out, 1)


def rounded_as_activations(ctx: Context, x: int, kind: int) -> int:
    """x [in, rows] (float32, contiguous) in values that ggml's rounding of activations to `kind` gives back
    exactly:
    - Q8_0, Q8_1 (for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): x in ggml's own Q8_0 blocks, read back (Q8_1 rounds as Q8_0
      does: blocks of 32, a float16 scale of the largest magnitude / 127);
    - Q8_K (for the K-quants, whose blocks ggml cannot copy to): blocks of 256, each a whole number of steps of its
      largest magnitude / 127 (plus 1e-37, which a block of zeros divides by and any other's step absorbs), which
      ggml's own rounding (a float32 step of the value of the largest magnitude / -127) takes back to within
      float32's rounding;
    - F16, BF16 (for weights of those types): x in that type, read back (ggml's products convert as its copies do,
      to the nearest)."""
    if kind not in ROUNDED_ACTIVATIONS:
        raise ValueError(f"no rounding known for ggml's activations of type {kind}")
    (rows_in, rows, *_), _ = shape(x)
    if kind != Q8_K:
        copied = Q8_0 if kind == Q8_1 else kind
        return ctx.op("cpy", ctx.op("cpy", x, ctx.tensor(copied, rows_in, rows)), ctx.tensor(F32, rows_in, rows))
    blocks = ctx.op("reshape_2d", x, 256, rows_in * rows // 256)
    step = ctx.op("scale_bias", ctx.op("pool_1d", ctx.op("abs", blocks), POOL_MAX, 256, 256, 0), 1 / 127, 1e-37)
    return ctx.op("reshape_2d", ctx.op("mul", ctx.op("round", ctx.op("div", blocks, step)), step), rows_in, rows)


@functools.cache
def _repack_buffer_type(threads: int) -> int | None:
    """ggml's CPU_REPACK buffer type (its first "extra" one), where weights take the interleaved layout of its
    multi-row kernels for this CPU; None where this ggml has none."""
    g = lib(threads)
    reg = g.backend_cpu_reg()
    address = g.backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    types = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(address)(g.backend_reg_dev_get(reg, 0))
    return types[0] if types and types[0] else None


def aligned(memory: torch.Tensor) -> torch.Tensor:
    """The tensor, or a copy where ggml could not read it in place (not contiguous, or not 32-byte aligned)."""
    return memory if memory.is_contiguous() and memory.data_ptr() % 32 == 0 else memory.clone(
        memory_format=torch.contiguous_format)


def memory(tensor: int) -> torch.Tensor:
    """A contiguous ggml tensor's data, as uint8 torch memory over it (valid as long as the tensor's buffer)."""
    head = _TensorHead.from_address(tensor)
    return torch.frombuffer((ctypes.c_uint8 * (head.ne[3] * head.nb[3])).from_address(head.data), dtype=torch.uint8)


def shape(tensor: int) -> tuple[list[int], list[int]]:
    """A ggml tensor's (ne, nb): its sizes and byte strides, innermost first."""
    head = _TensorHead.from_address(tensor)
    return list(head.ne), list(head.nb)


class Context:
    """Metadata for up to `max_tensors` ggml tensors and a graph of up to `max_nodes` nodes; the tensors' data lives
    in torch tensors (`place`) or comes from a Graph's allocator. `op(name, ...)` adds an op: `op("mul_mat", w, x)`."""

    def __init__(self, threads: int, max_tensors: int, max_nodes: int = 0):
        g = self.lib = lib(threads)
        self.max_nodes = max_nodes
        size = max_tensors * g.tensor_overhead() + (g.graph_overhead_custom(max_nodes, False) if max_nodes else 0)
        self.ptr = g.init(_InitParams(size, None, True))
        self._buffers = []      # ggml's records of the torch memory placed here
        self._kept = []         # the torch tensors themselves, alive as long as this context

    def op(self, name: str, *args) -> int:
        return getattr(self.lib, name)(self.ptr, *args)

    def tensor(self, ggml_type: int, *ne: int) -> int:
        return self.op("new_tensor_4d", ggml_type, *ne, *(1,) * (4 - len(ne)))

    def place(self, memory: torch.Tensor, ggml_type: int | None = None, ne: tuple[int, ...] | None = None,
              tensor: int | None = None) -> int:
        """A ggml tensor over a contiguous torch tensor's memory: a new one of the memory's dtype and shape
        (innermost first in ggml) unless a ggml type (a quantized one, over uint8 blocks) and sizes are given, or
        `tensor`, an op's result that is then computed into this memory."""
        if not memory.is_contiguous() or memory.device.type != "cpu":
            raise ValueError("ggml reads contiguous CPU memory")
        if memory.data_ptr() % 32:
            raise ValueError("ggml needs 32-byte aligned tensor memory")
        if tensor is None:
            ggml_type = TORCH_TYPES[memory.dtype] if ggml_type is None else ggml_type
            tensor = self.tensor(ggml_type, *(ne or tuple(reversed(memory.shape))))
        nbytes = memory.numel() * memory.element_size()
        if self.lib.nbytes(tensor) != nbytes:
            raise ValueError(f"a ggml tensor of sizes {shape(tensor)[0]} takes {self.lib.nbytes(tensor)} bytes, "
                             f"not {nbytes}")
        buffer = self.lib.backend_cpu_buffer_from_ptr(memory.data_ptr(), nbytes)
        self._buffers.append(buffer)
        self._kept.append(memory)
        if self.lib.backend_tensor_alloc(buffer, tensor, memory.data_ptr()) != 0:
            raise RuntimeError("ggml refused to place a tensor at the given memory")
        return tensor

    def hold(self, owner) -> None:
        """Keep `owner` (what holds memory a tensor of this context reads) as long as this context."""
        self._kept.append(owner)

    def place_repacked(self, blocks: torch.Tensor, ggml_type: int, ne: tuple[int, ...]) -> int | None:
        """A weight's blocks copied into ggml's CPU_REPACK memory, interleaved for its multi-row kernels; None where
        ggml has no such layout for the type on this CPU (or no CPU_REPACK at all)."""
        buffer_type = _repack_buffer_type(self.lib.threads)
        if buffer_type is None:
            return None
        tensor = self.tensor(ggml_type, *ne)
        buffer = self.lib.backend_buft_alloc_buffer(buffer_type, self.lib.backend_buft_get_alloc_size(buffer_type,
                                                                                                        tensor))
        self._buffers.append(buffer)
        if self.lib.backend_tensor_alloc(buffer, tensor, self.lib.backend_buffer_get_base(buffer)) != 0:
            raise RuntimeError("ggml refused a tensor in its CPU_REPACK buffer")
        if not _TensorHead.from_address(tensor).extra:      # no repacked layout for this type here
            return None
        self.lib.backend_tensor_set(tensor, blocks.data_ptr(), 0, blocks.numel())
        return tensor

    def close(self) -> None:
        for buffer in self._buffers:
            self.lib.backend_buffer_free(buffer)
        self.lib.free(self.ptr)
        self._buffers, self._kept, self.ptr = [], [], None


class _Words:
    """int64 fields of a context's built tensors, set before each compute from a value per sequence (`set`): each
    field the value it was built with, plus its sequence's value times a scale, in one vector store per step."""

    def __init__(self, ctx: Context):
        self.base = ctx.lib.get_mem_buffer(ctx.ptr)
        self.words = np.ctypeslib.as_array((ctypes.c_int64 * (ctx.lib.get_mem_size(ctx.ptr) // 8))
                                           .from_address(self.base))
        # per field set: its word, whose value, its multiple, and what is added to it
        self.fields, self.which, self.scales, self.built = [], [], [], []

    def _follow(self, address: int, which: int, scale: int, built: int = 0) -> None:
        self.fields.append((address - self.base) // 8)
        self.which.append(which)
        self.scales.append(scale)
        self.built.append(built)

    def set(self, values: np.ndarray) -> None:
        self.words[self.fields] = self.built + values[self.which] * self.scales

    def freeze(self) -> None:
        """Followed: the index arrays as numpy's."""
        self.fields, self.which, self.scales, self.built = (np.asarray(a, dtype=np.int64) for a in (
            self.fields, self.which, self.scales, self.built))


class Lengths(_Words):
    """Sizes of a context's built tensors that follow lengths set before each compute: a graph planned (its memory
    allocated) for the largest lengths computes over smaller ones. A followed size and the strides after it (unless
    the tensor is a strided view, whose strides stay) scale with the length it follows."""

    def follow(self, tensor: int, dim: int, which: int, strided: bool = False,
               strides: tuple[int, ...] | None = None) -> None:
        """Size `dim` of `tensor`, as built, holds length number `which` (its largest); the strides that scale with
        it: `strides` (a permuted view's), or those after dim unless the tensor is a strided view."""
        head = _TensorHead.from_address(tensor)
        built = head.ne[dim]
        if strides is None:
            strides = () if strided else range(dim + 1, 4)
        fields = [(_TensorHead.ne.offset + 8 * dim, built)]
        fields += [(_TensorHead.nb.offset + 8 * i, head.nb[i]) for i in strides]
        for offset, value in fields:
            self._follow(tensor + offset, which, value // built)


class Starts(_Words):
    """Where views of memory that stays put (the KV pool) begin, set before each compute: a graph built with a view
    at the memory's start reads from the element set (a context wherever its slots lie), so one graph serves every
    place of the same shape."""

    def follow(self, view: int, which: int, scale: int) -> None:
        """The view begins `scale` bytes times start number `which` past where it was built. Only this tensor
        moves: a view built from it, or an allocation that sets views up again, would point where it was built."""
        self._follow(view + _TensorHead.data.offset, which, scale, _TensorHead.from_address(view).data)


class Graph:
    """The ops a context's outputs need, planned once: `compute()` runs them on the threadpool."""

    def __init__(self, ctx: Context, outputs: list[int]):
        g = self.lib = ctx.lib
        self.graph = g.new_graph_custom(ctx.ptr, ctx.max_nodes, False)
        for out in outputs:
            g.build_forward_expand(self.graph, out)
        self.allocator = g.gallocr_new(g.backend_cpu_buffer_type())
        if not g.gallocr_alloc_graph(self.allocator, self.graph):
            g.gallocr_free(self.allocator)
            raise MemoryError("ggml could not allocate a graph's intermediate tensors")
        self.plan = g.graph_plan(self.graph, g.threads, g.threadpool)
        self.work = torch.empty(max(1, self.plan.work_size), dtype=torch.uint8)
        self.plan.work_data = self.work.data_ptr()

    def compute(self) -> None:
        with self.lib.computing:
            failed = self.lib.graph_compute(self.graph, ctypes.byref(self.plan)) != 0
        if failed:
            raise RuntimeError("ggml's graph failed")

    def close(self) -> None:
        self.lib.gallocr_free(self.allocator)


class Planned:
    """The ops `build(ctx)` adds to a context of their own (its outputs, computed into torch memory placed there),
    planned once: `compute()` runs them again over what their inputs then hold, and returns `out`."""

    def __init__(self, threads: int, max_tensors: int, build: Callable[[Context], list[int]], out: torch.Tensor):
        self.ctx = Context(threads, max_tensors=max_tensors, max_nodes=max_tensors)
        try:
            self.graph = Graph(self.ctx, build(self.ctx))
        except BaseException:
            self.ctx.close()
            raise
        self.out = out
        self.close = weakref.finalize(self, _close_all, self.graph, self.ctx)

    def compute(self) -> torch.Tensor:
        self.graph.compute()
        return self.out


class Op(Planned):
    """One op of a weight and an input, computed into `out`, over memory that stays where it is, planned once:
    `compute()` runs it again over what the input then holds. weight(ctx) places the weight in the op's context; op:
    ggml's op's name, or a function of (ctx, weight, x) that builds the ops (`precise_product`)."""

    def __init__(self, op: str | Callable[[Context, int, int], int], weight, x: torch.Tensor, out: torch.Tensor,
                 threads: int):
        built = 32 if callable(op) else 4     # the tensors it may make: the weight, x, out and the ops'
        make = op if callable(op) else lambda ctx, w, x: ctx.op(op, w, x)
        super().__init__(threads, built, lambda ctx: [ctx.place(out, tensor=make(ctx, weight(ctx), ctx.place(x)))],
                         out)
        self.x = x


class Copy(Planned):
    """A tensor (source(ctx) places it) copied into out's memory as out's type, planned once: `compute()` runs it
    again over what the source then holds. A weight's blocks come out so dequantized to float32 on every thread of
    the pool: ggml's copy splits their rows among its threads where its get_rows takes one (8192x2048 weights
    with a 64-row product after each, 2-core Xeon: Q4_K 7.1 against 10.9 ms, Q6_K 15.4 against 25.4, BF16 6.8
    against 11.9, Q4_0, Q4_1 and Q8_0 even)."""

    def __init__(self, source: Callable[[Context], int], out: torch.Tensor, threads: int):
        super().__init__(threads, 4, lambda ctx: [ctx.op("cpy", source(ctx), ctx.place(out))], out)


class Product(Op):
    """y = x @ W.T for x [rows, in] float32 and W [out, in] in ggml blocks (uint8), planned once: `run()` reads
    `self.x` and returns `self.y`, both reused call after call."""

    def __init__(self, weight: torch.Tensor, ggml_type: int, in_features: int, out_features: int, rows: int,
                 threads: int, repacked: bool = False):
        """repacked: the weight copied into ggml's interleaved layout (`Context.place_repacked`); raises ValueError
        where ggml has none for its type here."""
        self.weight = weight
        self.x = torch.empty(rows, in_features, dtype=torch.float32)
        self.y = torch.empty(rows, out_features, dtype=torch.float32)
        ne = (in_features, out_features)

        def placed(ctx: Context) -> int:
            w = ctx.place_repacked(weight, ggml_type, ne) if repacked else ctx.place(weight, ggml_type, ne)
            if w is None:
                raise ValueError(f"ggml has no repacked layout for type {ggml_type} on this CPU")
            return w
        super().__init__("mul_mat", placed, self.x, self.y, threads)

    def run(self) -> torch.Tensor:
        return self.compute()


def _close_all(*closables) -> None:
    for closable in closables:
        closable.close()
