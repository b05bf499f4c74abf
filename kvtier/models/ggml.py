"""ggml's CPU matrix products over GGUF's own quantized blocks, through ctypes and the prebuilt `libggml-python`
wheel (shared libraries only, nothing compiled at install): the CPU candidate for quantized weights that
`kvtier bench kernels` measures beside torch's products.

A `Product` is planned once for a weight and a row count: ggml tensors placed at the caller's memory (the weight's
bytes as the GGUF file holds them, the input rows, the output), a graph of one matrix product, and a plan on a
threadpool that lives as long as the process, so a call costs one ggml compute and no allocation or thread start.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

_P = ctypes.c_void_p
# struct ggml_threadpool_params: bool cpumask[GGML_MAX_N_THREADS = 512]; int n_threads; enum prio; uint32_t poll; ...
_POLL_OFFSET = 512 + 4 + 4


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):     # ggml-cpu.h, struct ggml_cplan
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", _P), ("n_threads", ctypes.c_int), ("threadpool", _P),
                ("abort_callback", _P), ("abort_callback_data", _P), ("use_ref", ctypes.c_bool)]


class _Lib:
    """The ggml functions kvtier calls, and one threadpool of `threads` threads."""

    def __init__(self, threads: int):
        import libggml
        directory = os.path.join(os.path.dirname(libggml.__file__), "lib64")
        base = ctypes.CDLL(os.path.join(directory, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(os.path.join(directory, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)

        def fn(lib, name, restype, *argtypes):
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, list(argtypes)
            return f
        self.init = fn(base, "ggml_init", _P, _InitParams)
        self.new_tensor_2d = fn(base, "ggml_new_tensor_2d", _P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        self.mul_mat = fn(base, "ggml_mul_mat", _P, _P, _P, _P)
        self.new_graph = fn(base, "ggml_new_graph", _P, _P)
        self.build_forward_expand = fn(base, "ggml_build_forward_expand", None, _P, _P)
        self.nbytes = fn(base, "ggml_nbytes", ctypes.c_size_t, _P)
        self.row_size = fn(base, "ggml_row_size", ctypes.c_size_t, ctypes.c_int, ctypes.c_int64)
        self.quantize_chunk = fn(base, "ggml_quantize_chunk", ctypes.c_size_t, ctypes.c_int, _P, _P, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, _P)
        self.tensor_alloc = fn(base, "ggml_backend_tensor_alloc", ctypes.c_int, _P, _P, _P)
        self.buffer_from_ptr = fn(cpu, "ggml_backend_cpu_buffer_from_ptr", _P, _P, ctypes.c_size_t)
        self.graph_plan = fn(cpu, "ggml_graph_plan", _CPlan, _P, ctypes.c_int, _P)
        self.graph_compute = fn(cpu, "ggml_graph_compute", ctypes.c_int, _P, ctypes.POINTER(_CPlan))
        params = ctypes.create_string_buffer(1024)      # struct ggml_threadpool_params (~530 bytes), filled by ggml
        fn(base, "ggml_threadpool_params_init", None, _P, ctypes.c_int)(params, threads)
        # poll 0: its threads sleep between products instead of spinning, which would starve torch's threads
        ctypes.c_uint32.from_buffer(params, _POLL_OFFSET).value = 0
        self.threads = threads
        self.threadpool = fn(cpu, "ggml_threadpool_new", _P, _P)(params)


def available() -> bool:
    try:
        import libggml  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def lib(threads: int) -> _Lib:
    return _Lib(threads)


def quantize(weight: torch.Tensor, ggml_type: int, threads: int = 1) -> torch.Tensor:
    """A float32 weight [out, in] as ggml blocks of `ggml_type` (GGUF's numbering), uint8, row after row."""
    g = lib(threads)
    rows, cols = weight.shape
    src = weight.detach().float().contiguous()
    out = torch.empty(g.row_size(ggml_type, cols) * rows, dtype=torch.uint8)
    g.quantize_chunk(ggml_type, src.data_ptr(), out.data_ptr(), 0, rows, cols, None)
    return out


class Product:
    """y = x @ W.T for x [rows, in] float32 and W [out, in] in ggml blocks (uint8, 32-byte aligned: torch's CPU
    tensors are 64-byte aligned), planned once: `run()` reads `self.x` and returns `self.y`, both reused call after call."""

    def __init__(self, weight: torch.Tensor, ggml_type: int, in_features: int, out_features: int, rows: int,
                 threads: int):
        g = self.lib = lib(threads)
        self.ctx = g.init(_InitParams(1 << 20, None, True))      # metadata (a graph takes ~80 KB); the data is ours
        w = g.new_tensor_2d(self.ctx, ggml_type, in_features, out_features)
        if g.nbytes(w) != weight.numel():
            raise ValueError(f"a {out_features}x{in_features} weight of ggml type {ggml_type} takes {g.nbytes(w)} "
                             f"bytes, not {weight.numel()}")
        x = g.new_tensor_2d(self.ctx, 0, in_features, rows)      # 0: GGML_TYPE_F32
        y = g.mul_mat(self.ctx, w, x)
        self.weight = weight
        self.x = torch.empty(rows, in_features, dtype=torch.float32)
        self.y = torch.empty(rows, out_features, dtype=torch.float32)
        for tensor, memory in ((w, weight), (x, self.x), (y, self.y)):
            address = memory.data_ptr()
            if address % 32:
                raise ValueError("ggml needs 32-byte aligned tensor memory")
            buffer = g.buffer_from_ptr(address, memory.numel() * memory.element_size())
            if g.tensor_alloc(buffer, tensor, address) != 0:
                raise RuntimeError("ggml refused to place a tensor at the given memory")
        self.graph = g.new_graph(self.ctx)
        g.build_forward_expand(self.graph, y)
        self.plan = g.graph_plan(self.graph, threads, g.threadpool)
        self.work = torch.empty(max(1, self.plan.work_size), dtype=torch.uint8)
        self.plan.work_data = self.work.data_ptr()

    def run(self) -> torch.Tensor:
        if self.lib.graph_compute(self.graph, ctypes.byref(self.plan)) != 0:
            raise RuntimeError("ggml's matrix product failed")
        return self.y

